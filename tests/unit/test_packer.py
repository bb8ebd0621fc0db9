from __future__ import annotations

import numpy as np
import pytest

from cbpipe.protocol.messages import SamplingMode
from cbpipe.protocol.sampling import SamplingParams
from cbpipe.protocol.slots import SlotLayout, SlotLimits, numpy_views
from cbpipe.scheduler.block_manager import BlockManager
from cbpipe.scheduler.core import Scheduler
from cbpipe.scheduler.packer import BatchPacker
from cbpipe.scheduler.request import Request

BLOCK = 4


def setup() -> tuple[Scheduler, BatchPacker, memoryview, SlotLayout]:
    layout = SlotLayout.build(SlotLimits(max_tokens=32, max_seqs=4, max_blocks_per_seq=8))
    buffer = memoryview(bytearray(layout.segment_nbytes))
    scheduler = Scheduler(BlockManager(32, BLOCK), max_num_seqs=4, max_batch_tokens=32)
    return scheduler, BatchPacker(buffer, layout, BLOCK), buffer, layout


def request(request_id: int, prompt: list[int], **params) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(8, **params),
        seed=100 + request_id,
        max_total_tokens=32,
        eos_token_ids=frozenset(),
    )


def test_packed_prefill_rows_sequences_and_block_tables() -> None:
    scheduler, packer, buffer, layout = setup()
    a = request(1, [11, 12, 13, 14, 15, 16], temperature=0.5, top_k=3, top_p=0.8)
    b = request(2, [21])
    scheduler.add_request(a)
    scheduler.add_request(b)
    plan = scheduler.schedule()
    step = packer.pack(plan, slot=1, previous_slot=None)
    views = numpy_views(buffer, layout, 1)
    # b has one query token, so it comes first.
    assert [s.req for s in plan.seqs] == [b, a]
    assert (step.num_tokens, step.num_seqs, step.num_single_token_seqs) == (7, 2, 1)
    assert (step.max_query_len, step.max_context_len, step.block_table_width) == (6, 6, 2)
    assert step.carry_from_slot is None and step.sampling is SamplingMode.FULL
    assert views.inputs.input_ids[:7].tolist() == [21, 11, 12, 13, 14, 15, 16]
    assert views.inputs.positions[:7].tolist() == [0, 0, 1, 2, 3, 4, 5]
    assert views.inputs.query_start[:3].tolist() == [0, 1, 7]
    assert views.inputs.context_lens[:2].tolist() == [1, 6]
    tables = views.inputs.block_tables[:4].reshape(2, 2)
    assert tables[0, 0] == b.block_ids[0] and tables[1].tolist() == a.block_ids
    expected_slots = [b.block_ids[0] * BLOCK] + [
        a.block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(6)
    ]
    assert views.inputs.slot_mapping[:7].tolist() == expected_slots
    assert views.inputs.seed[:2].tolist() == [102, 101]
    assert np.allclose(views.inputs.temperature[:2], [0.0, 0.5])
    assert views.inputs.header.tolist() == [plan.step, 7, 2, 2]
    assert not views.inputs.carry_mask[:7].any()


def test_decode_rows_carry_the_previous_steps_token() -> None:
    scheduler, packer, buffer, layout = setup()
    a = request(1, [11, 12, 13])
    scheduler.add_request(a)
    packer.pack(scheduler.schedule(), slot=0, previous_slot=None)
    step = packer.pack(scheduler.schedule(), slot=1, previous_slot=0)
    views = numpy_views(buffer, layout, 1)
    assert step.carry_from_slot == 0
    assert views.inputs.carry_mask[0] and views.inputs.carry_src[0] == 0
    assert views.inputs.positions[0] == 3 and views.inputs.output_index[0] == 1


def test_carry_over_without_a_previous_step_is_refused() -> None:
    scheduler, packer, _, _ = setup()
    scheduler.add_request(request(1, [11, 12]))
    scheduler.schedule()
    with pytest.raises(ValueError, match="carries tokens over"):
        packer.pack(scheduler.schedule(), slot=1, previous_slot=None)
