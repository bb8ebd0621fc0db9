from __future__ import annotations

import random

import numpy as np
import pytest

from cbpipe.protocol.messages import SamplingMode, Step
from cbpipe.protocol.sampling import SamplingParams
from cbpipe.protocol.slots import SlotLayout, SlotLimits, SlotViews, numpy_views
from cbpipe.scheduler.block_manager import BlockManager
from cbpipe.scheduler.core import Scheduler, StepOutput, StepPlan
from cbpipe.scheduler.packer import BatchPacker
from cbpipe.scheduler.request import Request

BLOCK = 4
EOS = 1


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


# --- the packer against a row-by-row reference, over a random workload ------------------------


def _reference_inputs(plan: StepPlan, block_size: int) -> dict[str, list]:
    """Every input field a step uses, written out row by row and sequence by sequence from
    the plan and its requests as they are when it is packed: what the packer's columns and
    block-table gathers must reproduce."""
    rows: dict[str, list] = {name: [] for name in ("input_ids", "positions", "slot_mapping")}
    rows["carry_mask"], rows["carry_src"] = [], []
    for seq in plan.seqs:
        req = seq.req
        for position in range(seq.start, seq.start + seq.num_query_tokens):
            carried = seq.carry_src is not None
            block = req.block_ids[position // block_size]
            rows["positions"].append(position)
            rows["slot_mapping"].append(block * block_size + position % block_size)
            rows["carry_mask"].append(carried)
            rows["carry_src"].append(seq.carry_src if carried else 0)
            rows["input_ids"].append(0 if carried else req.token_at(position))
    assigned_rows = {req.table_row for req in plan.assigned}
    lengths = [s.num_query_tokens for s in plan.seqs]
    width = max(len(s.req.block_ids) for s in plan.seqs)
    return {
        **rows,
        "query_start": [sum(lengths[:i]) for i in range(len(lengths) + 1)],
        "context_lens": [s.start + s.num_query_tokens for s in plan.seqs],
        "output_index": [s.output_index for s in plan.seqs],
        "request_row": [s.req.table_row for s in plan.seqs],
        "resets_row": [s.req.table_row in assigned_rows for s in plan.seqs],
        "has_prompt_logprobs": [s.prompt_logprobs for s in plan.seqs],
        "temperature": [s.req.params.temperature for s in plan.seqs],
        "top_k": [s.req.params.top_k for s in plan.seqs],
        "seed": [s.req.seed for s in plan.seqs],
        "num_prompt_tokens": [s.req.num_prompt_tokens for s in plan.seqs],
        "block_tables": [s.req.block_ids for s in plan.seqs],
        "header": [plan.step, sum(lengths), len(plan.seqs), width],
    }


def _packed_inputs(views: SlotViews, step: Step) -> dict[str, list]:
    inputs, n, t = views.inputs, step.num_seqs, step.num_tokens
    packed: dict[str, list] = {
        name: getattr(inputs, name)[:t].tolist()
        for name in ("input_ids", "positions", "slot_mapping", "carry_mask", "carry_src")
    }
    for name in (
        "context_lens", "output_index", "request_row", "resets_row", "has_prompt_logprobs",
        "temperature", "top_k", "seed", "num_prompt_tokens",
    ):  # fmt: skip
        packed[name] = getattr(inputs, name)[:n].tolist()
    packed["query_start"] = inputs.query_start[: n + 1].tolist()
    tables = inputs.block_tables[: n * step.block_table_width].reshape(n, -1)
    context_lens = packed["context_lens"]
    packed["block_tables"] = [tables[i, : -(-context_lens[i] // BLOCK)].tolist() for i in range(n)]
    packed["header"] = inputs.header.tolist()
    return packed


def _random_params(rng: random.Random) -> SamplingParams:
    options: dict = {"seed": rng.randrange(1000), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.4:
        options["temperature"] = 0.5  # exact in float32
    if rng.random() < 0.2:
        options["top_k"] = 5
    if rng.random() < 0.2:
        options["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.1:
        options["prompt_logprobs"] = 1
    if rng.random() < 0.2:
        options["stop_token_ids"] = (rng.randrange(3, 64),)
    return SamplingParams(rng.randint(1, 12), **options)


@pytest.mark.parametrize(
    ("seed", "num_slots", "prefix_caching", "num_blocks"),
    [(0, 2, True, 24), (1, 3, False, 16), (2, 2, False, 64), (3, 3, True, 14), (4, 2, True, 12)],
)
def test_packed_slots_match_a_row_by_row_reference_over_a_random_workload(
    seed: int, num_slots: int, prefix_caching: bool, num_blocks: int
) -> None:
    """Prefill chunks beside decodes, admissions, finishes by EOS, stop token and length,
    cancellations, preemptions, and every slot reused with up to ``num_slots`` steps in
    flight: each packed slot holds what the reference writes row by row, and each step's
    message says what the plan holds."""
    rng = random.Random(seed)
    max_total = 40
    layout = SlotLayout.build(SlotLimits(24, 8, max_total // BLOCK), num_slots=num_slots)
    buffer = memoryview(bytearray(layout.segment_nbytes))
    scheduler = Scheduler(
        BlockManager(num_blocks, BLOCK, prefix_caching=prefix_caching),
        max_num_seqs=8,
        max_batch_tokens=24,
    )
    packer = BatchPacker(buffer, layout, BLOCK)
    shared = [rng.randrange(3, 64) for _ in range(12)]
    in_flight: list[tuple[StepPlan, Step, int]] = []
    next_id, num_steps, carried, preempted, sample_modes = 0, 0, 0, 0, set()

    def add_request() -> None:
        nonlocal next_id
        next_id += 1
        prompt = shared[: rng.choice((0, 4, 9, 12))] + [
            rng.randrange(3, 64) for _ in range(rng.randint(1, 20))
        ]
        scheduler.add_request(
            Request(next_id, prompt, _random_params(rng), next_id, max_total, frozenset({EOS}))
        )

    def apply_oldest() -> None:
        plan, step, slot = in_flight.pop(0)
        sampled = [EOS if rng.random() < 0.05 else rng.randrange(3, 64) for _ in plan.seqs]
        packer.views(slot).outputs.sampled_ids[: len(sampled)] = sampled
        scheduler.update(plan, packer.read_output(slot, step))

    for _ in range(8):
        add_request()
    while scheduler.requests and num_steps < 300:
        if rng.random() < 0.15 and num_steps < 150:
            add_request()
        if rng.random() < 0.03 and scheduler.running:
            scheduler.cancel(rng.choice(scheduler.running).request_id)
        if len(in_flight) == num_slots or not scheduler.has_work:
            apply_oldest()
            continue
        plan = scheduler.schedule()
        if not plan.seqs:
            apply_oldest()
            continue
        slot = num_steps % num_slots
        previous = in_flight[-1][2] if in_flight else None
        expected = _reference_inputs(plan, BLOCK)
        step = packer.pack(plan, slot, previous)
        assert _packed_inputs(packer.views(slot), step) == expected
        lengths = [s.num_query_tokens for s in plan.seqs]
        decodes = lengths.count(1)
        assert lengths[:decodes] == [1] * decodes  # one-token rows first
        assert (step.num_seqs, step.num_tokens, step.num_single_token_seqs) == (
            len(lengths),
            sum(lengths),
            decodes,
        )
        assert step.max_query_len == max(lengths)
        assert step.max_context_len == max(expected["context_lens"])
        assert step.block_table_width == expected["header"][3]
        carries = any(s.carry_src is not None for s in plan.seqs)
        assert step.carry_from_slot == (previous if carries else None)
        for seq in plan.seqs:  # a carried row reads the sample of its request's last row
            if seq.carry_src is not None:
                source = in_flight[-1][0].seqs[seq.carry_src]
                assert source.req is seq.req and source.samples
        assert step.top_logprobs == any(bool(s.req.params.logprobs) for s in plan.seqs)
        carried += carries
        preempted += len(plan.preempted)
        sample_modes.add(step.sampling)
        in_flight.append((plan, step, slot))
        num_steps += 1
        scheduler.check_invariants()
    while in_flight:
        apply_oldest()
    assert carried > 20 and len(sample_modes) > 1
    assert preempted > 0 or num_blocks == 64  # only the roomiest cache never runs short


def test_token_masks_go_with_the_constrained_sequences_that_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A constrained request's step is FULL; its mask is written only in a step in which it
    samples (not a prompt chunk before its last), with its bias entries after it, filtered by
    the mask; an unconstrained request's bias is packed as before."""
    from cbpipe.protocol.sampling import StructuredOutput

    layout = SlotLayout.build(
        SlotLimits(max_tokens=32, max_seqs=4, max_blocks_per_seq=8, vocab_size=64)
    )
    buffer = memoryview(bytearray(layout.segment_nbytes))
    scheduler = Scheduler(BlockManager(32, BLOCK), max_num_seqs=4, max_batch_tokens=8)
    packer = BatchPacker(buffer, layout, BLOCK)

    class Grammar:  # allows tokens 2..9 and the bias's 40; llguidance's fill, by hand
        executor = None

    masks_filled: list[int] = []

    def fill(grammars, masks):  # type: ignore[no-untyped-def]
        masks_filled.append(len(grammars))
        masks[: len(grammars)] = 0
        masks[: len(grammars), 0] = 0b1111111100
        masks[: len(grammars), 1] = 1 << 8  # token 40

    monkeypatch.setattr("cbpipe.scheduler.packer.fill_masks", fill)
    spec = StructuredOutput(regex="x")
    constrained = request(1, list(range(10, 22)), structured_output=spec,
                          logit_bias=((40, 2.0), (50, 3.0)))  # fmt: skip
    constrained.grammar = Grammar()  # type: ignore[assignment]
    free = request(2, [5], logit_bias=((9, 1.0),))
    for req in (constrained, free):
        scheduler.add_request(req)
    first = scheduler.schedule()  # 8 of the constrained prompt's 12 tokens: no sampling
    step = packer.pack(first, 0, None)
    assert step.sampling is SamplingMode.FULL and step.num_token_masks == 0
    assert masks_filled == []
    scheduler.update(first, StepOutput.of_ids([0] * len(first.seqs)))
    second = scheduler.schedule()  # the rest of its prompt, and the other's
    step = packer.pack(second, 1, None)
    views = numpy_views(buffer, layout, 1)
    assert step.num_token_masks == 1 and masks_filled == [1]
    index = [seq.req for seq in second.seqs].index(constrained)
    assert views.extras.mask_seqs[0] == index
    assert views.extras.token_masks[0] == 0b1111111100
    entries = list(
        zip(
            views.extras.bias_rows[: step.num_bias_entries].tolist(),
            views.extras.bias_token_ids[: step.num_bias_entries].tolist(),
            views.extras.bias_values[: step.num_bias_entries].tolist(),
            strict=True,
        )
    )
    # Token 50 is outside the mask: its bias would lift its ban.
    assert (constrained.table_row, 40, 2.0) in entries
    assert all(token != 50 for _, token, _ in entries)
