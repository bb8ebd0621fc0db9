import numpy as np
import pytest

from cbpipe.protocol.liveness import TABLE_NBYTES
from cbpipe.protocol.slots import ALIGN, FIELDS, SlotLayout, SlotLimits, numpy_views


def test_fields_are_aligned_disjoint_and_inputs_come_first() -> None:
    layout = SlotLayout.build(SlotLimits(max_tokens=100, max_seqs=7, max_blocks_per_seq=13), 3)
    spans = sorted((f.offset, f.offset + f.nbytes, f.spec.region) for f in layout.fields.values())
    for (start, end, _), (next_start, _, _) in zip(spans, spans[1:], strict=False):
        assert start % ALIGN == 0 and end <= next_start
    for region in ("inputs", "extras", "outputs"):
        start, end = layout.region(region)
        inside = [s for s in spans if s[2] == region]
        assert inside and start <= min(s[0] for s in inside) <= max(s[1] for s in inside) <= end
    assert layout.region("inputs")[1] <= layout.region("extras")[0]
    assert layout.region("extras")[1] <= layout.region("outputs")[0]
    assert layout.slot_nbytes % ALIGN == 0
    assert layout.segment_nbytes == TABLE_NBYTES + 3 * layout.slot_nbytes  # heartbeats first
    assert layout.slot_offset(1) == TABLE_NBYTES + layout.slot_nbytes
    assert layout.fields["block_tables"].length == 7 * 13
    assert set(layout.fields) == {f.name for f in FIELDS}
    assert len(layout.fields) == len(FIELDS)  # no name in two regions


def test_block_tables_are_last_so_a_prefix_copy_covers_a_step() -> None:
    layout = SlotLayout.build(SlotLimits(64, 8, 10))
    tables = layout.fields["block_tables"]
    others = [f for f in layout.fields.values() if f.spec.region == "inputs" and f is not tables]
    assert all(f.offset < tables.offset for f in others)
    assert layout.input_nbytes_used(num_seqs=3, block_table_width=4) == tables.offset + 3 * 4 * 4


def test_views_of_two_slots_do_not_alias() -> None:
    layout = SlotLayout.build(SlotLimits(16, 4, 4))
    buffer = memoryview(bytearray(layout.segment_nbytes))
    first, second = numpy_views(buffer, layout, 0), numpy_views(buffer, layout, 1)
    first.inputs.input_ids[:] = 7
    second.outputs.sampled_ids[:] = 9
    assert not second.inputs.input_ids.any()
    assert not first.outputs.sampled_ids.any()
    assert first.inputs.block_tables.dtype == np.int32 and first.inputs.block_tables.size == 16


def test_output_groups_are_prefixes_of_the_output_region() -> None:
    layout = SlotLayout.build(SlotLimits(16, 4, 4))
    start, end = layout.region("outputs")
    sampled = layout.output_nbytes_used(top_logprobs=False, prompt_logprobs=False)
    top = layout.output_nbytes_used(top_logprobs=True, prompt_logprobs=False)
    prompt = layout.output_nbytes_used(top_logprobs=True, prompt_logprobs=True)
    assert 0 < sampled < top < prompt == end - start
    logprobs = layout.fields["sampled_logprobs"]
    assert logprobs.offset + logprobs.nbytes - start == sampled


def test_limits_and_slot_count_are_checked() -> None:
    with pytest.raises(ValueError):
        SlotLimits(0, 1, 1)
    with pytest.raises(ValueError):
        SlotLayout.build(SlotLimits(1, 1, 1), num_slots=1)
    with pytest.raises(IndexError):
        SlotLayout.build(SlotLimits(1, 1, 1)).slot_offset(2)
