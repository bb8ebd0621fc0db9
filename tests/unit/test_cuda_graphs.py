"""Which decode and mixed-step bodies exist, the order they first run in, and which one a step
replays (on the CPU, nothing captured)."""

import dataclasses

from cbpipe.protocol.messages import SamplingMode, Step
from cbpipe.worker.cuda_graphs import (
    FULL_VARIANTS,
    GREEDY,
    LOGITS_HANDOFF,
    MAX_GRAPH_CHUNKS,
    RANDOM,
    DecodeGraphs,
    GraphVariant,
    MixedGraphs,
    MixedShape,
    bucket_sizes,
    compiled_bucket_sizes,
    full_bucket_sizes,
    mixed_bucket_sizes,
    split_decode_rows,
    tuning_batch,
)


def test_buckets_are_fine_at_the_bottom_and_end_at_the_largest_batch() -> None:
    assert bucket_sizes(6) == [1, 2, 4, 6]
    sizes = bucket_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert sizes == sorted(set(sizes))


def test_the_tuning_batch_is_the_smallest_bucket_of_at_least_32_rows() -> None:
    assert tuning_batch(bucket_sizes(256)) == 32
    assert tuning_batch([1, 2, 4, 8, 16, 24, 40, 48]) == 40
    assert tuning_batch([1, 2, 4, 6]) == 6  # none that large: the largest


def test_compiled_buckets_leave_out_batch_1_where_a_larger_one_serves() -> None:
    assert compiled_bucket_sizes(bucket_sizes(256))[:3] == [2, 4, 8]
    assert compiled_bucket_sizes([1]) == [1]
    assert compiled_bucket_sizes([2, 4]) == [2, 4]


def test_the_full_samplers_buckets_are_powers_of_two_from_8_and_the_largest() -> None:
    assert full_bucket_sizes(bucket_sizes(256)) == [8, 16, 32, 64, 128, 256]
    assert full_bucket_sizes(bucket_sizes(200)) == [8, 16, 32, 64, 128, 200]
    assert full_bucket_sizes(bucket_sizes(6)) == [6]
    assert full_bucket_sizes([32]) == [32]


def _step(**fields: object) -> Step:
    step = Step(step=0, slot=1, num_tokens=20, num_seqs=20, num_single_token_seqs=20,
                max_query_len=1, max_context_len=100, block_table_width=8,
                carry_from_slot=None, sampling=SamplingMode.GREEDY, top_logprobs=False,
                prompt_logprobs=False, num_bias_entries=0)  # fmt: skip
    return dataclasses.replace(step, **fields)


class _Halves:
    """Records the calls of a decode body's two halves; the forward's outputs name its batch."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def forward(self, slot: str, batch: int) -> tuple[object, ...]:
        self.calls.append(("forward", slot, batch))
        return ("outputs of", batch)

    def sample(self, slot: str, batch: int, variant: GraphVariant, outputs: object) -> None:
        self.calls.append(("sample", slot, batch, variant, outputs))


def test_a_first_batch_runs_before_every_capture_in_every_variant() -> None:
    halves = _Halves()
    graphs = DecodeGraphs()
    graphs.capture(
        halves.forward,  # type: ignore[arg-type]
        halves.sample,  # type: ignore[arg-type]
        batch_sizes=[1, 2, 4, 8, 16, 32, 64],
        slot="graph slot",
        stream=None,
        first_batch=32,
    )
    # One forward at the first batch feeds every variant's sampling; the CPU runs the bodies
    # at replay only.
    assert halves.calls == [("forward", "graph slot", 32)] + [
        ("sample", "graph slot", 32, v, ("outputs of", 32))
        for v in (GREEDY, RANDOM, *FULL_VARIANTS)
    ]
    assert graphs.full_batch_sizes == [8, 16, 32, 64]
    assert len(graphs) == 7 * 2 + 4 * 4  # one set, whatever slot a step comes in

    def replayed(step: Step, **kwargs: bool) -> list[tuple[object, ...]]:
        before = len(halves.calls)
        graph = graphs.find(step, **kwargs)
        assert graph is not None
        graph.replay()
        return halves.calls[before:]

    def pair(batch: int, variant: GraphVariant) -> list[tuple[object, ...]]:
        return [
            ("forward", "graph slot", batch),
            ("sample", "graph slot", batch, variant, ("outputs of", batch)),
        ]

    assert replayed(_step()) == pair(32, GREEDY)
    assert graphs.find(_step(slot=0)) is graphs.find(_step(slot=1))
    random = _step(sampling=SamplingMode.RANDOM, num_seqs=3, num_single_token_seqs=3)
    assert replayed(random) == pair(4, RANDOM)
    full = _step(sampling=SamplingMode.FULL, num_seqs=3, num_single_token_seqs=3)
    assert replayed(full) == pair(8, GraphVariant(SamplingMode.FULL))
    assert replayed(dataclasses.replace(full, top_logprobs=True), truncation=True) == pair(
        8, GraphVariant(SamplingMode.FULL, True, True)
    )


def test_prefill_and_prompt_log_probability_steps_run_eagerly() -> None:
    graphs = DecodeGraphs()
    halves = _Halves()
    graphs.capture(
        halves.forward,  # type: ignore[arg-type]
        halves.sample,  # type: ignore[arg-type]
        batch_sizes=[1, 2, 4],
        slot="graph slot",
        stream=None,
    )
    assert graphs.find(_step(num_seqs=2, num_single_token_seqs=2)) is not None
    assert graphs.find(_step(num_seqs=2, num_single_token_seqs=1)) is None
    assert graphs.find(_step(num_seqs=2, num_single_token_seqs=2, prompt_logprobs=True)) is None
    assert graphs.find(_step(num_seqs=5, num_single_token_seqs=5)) is None  # past the largest


def test_mixed_buckets_are_finer_where_padding_costs_most() -> None:
    assert mixed_bucket_sizes(0) == []
    assert mixed_bucket_sizes(100) == [32, 64, 96, 100]
    sizes = mixed_bucket_sizes(2176)
    assert sizes == sorted(set(sizes)) and sizes[-1] == 2176
    # A step pads to its bucket: at most 31 rows up to 256, 63 up to 1,024, 127 above.
    for below, size in zip([0, *sizes], sizes, strict=False):
        assert size - below == (32 if size <= 256 else 64 if size <= 1024 else 128), size


class _MixedHalves:
    """A mixed body's two halves, recording which shape and variant each replay ran."""

    def __init__(self) -> None:
        self.calls: list[tuple[MixedShape, GraphVariant]] = []

    def forward(self, slot: str, shape: MixedShape) -> MixedShape:
        return shape

    def sample(self, slot: str, shape: MixedShape, variant: GraphVariant, outputs: object) -> None:
        assert outputs == shape
        self.calls.append((shape, variant))

    def bound(self, max_tokens: int) -> MixedGraphs:
        """Mixed graphs of these halves up to ``max_tokens`` rows, bound as on the CPU."""
        graphs = MixedGraphs()
        graphs.capture(
            self.forward,  # type: ignore[arg-type]
            self.sample,  # type: ignore[arg-type]
            token_sizes=mixed_bucket_sizes(max_tokens),
            slot="graph slot",
            stream=None,
            pool=None,
        )
        return graphs


def test_a_mixed_step_replays_the_smallest_bucket_it_fits_with_its_split_and_sampler() -> None:
    halves = _MixedHalves()
    graphs = halves.bound(512)
    # Split or not; greedy, temperature, or the logits handed to the eager full sampler.
    assert len(graphs) == len(mixed_bucket_sizes(512)) * 2 * 3

    def replayed(step: Step, split: bool) -> tuple[MixedShape, GraphVariant]:
        graph = graphs.find(step, split=split)
        assert graph is not None
        graph.replay()
        return halves.calls[-1]

    # 253 decodes beside a chunk of 127 rows: 380 rows, in the bucket of 384.
    mixed = _step(num_tokens=380, num_seqs=254, num_single_token_seqs=253, max_query_len=127)
    assert replayed(mixed, split=False) == (MixedShape(384, False), GREEDY)
    assert replayed(mixed, split=True) == (MixedShape(384, True), GREEDY)
    at_edge = dataclasses.replace(mixed, num_tokens=512, sampling=SamplingMode.RANDOM)
    assert replayed(at_edge, split=False) == (MixedShape(512, False), RANDOM)
    full = dataclasses.replace(mixed, sampling=SamplingMode.FULL)
    assert replayed(full, split=True) == (MixedShape(384, True), LOGITS_HANDOFF)
    # A prompt's first chunk alone, no decodes beside it, is a mixed step too.
    assert replayed(_step(num_tokens=40, num_seqs=1, num_single_token_seqs=0), False) == (
        MixedShape(64, False),
        GREEDY,
    )


def test_mixed_steps_past_the_graphs_run_eagerly() -> None:
    graphs = _MixedHalves().bound(512)
    mixed = _step(num_tokens=300, num_seqs=30, num_single_token_seqs=28, max_query_len=150)
    assert graphs.find(mixed, split=False) is not None
    most = dataclasses.replace(mixed, num_seqs=28 + MAX_GRAPH_CHUNKS)
    assert graphs.find(most, split=False) is not None
    assert graphs.eager_reason(mixed) is None
    chunks = MAX_GRAPH_CHUNKS + 1
    for eager, reason in (
        (dataclasses.replace(mixed, num_tokens=513), "513 rows, more than the largest graph's 512"),
        (dataclasses.replace(mixed, num_seqs=28 + chunks), f"{chunks} prefill chunks, more"),
        (dataclasses.replace(mixed, prompt_logprobs=True), "prompt log-probabilities"),
        (dataclasses.replace(mixed, num_seqs=28), "decodes only"),
    ):
        assert graphs.find(eager, split=False) is None, eager
        assert (graphs.eager_reason(eager) or "").startswith(reason), eager
    assert MixedGraphs().find(mixed, split=False) is None
    assert MixedGraphs().eager_reason(mixed) == "no mixed graphs"


def test_a_split_mixed_graph_decodes_only_the_rows_a_split_step_can_have() -> None:
    def splitting_below(threshold: int):  # as launch_grid: splits until the rows fill the SMs
        return lambda rows: 64 if rows < threshold else 1

    for threshold in (2, 3, 33, 200, 256):
        assert split_decode_rows(256, splitting_below(threshold)) == threshold - 1
    assert split_decode_rows(256, splitting_below(10_000)) == 256  # every row count splits
    assert split_decode_rows(256, splitting_below(1)) == 1  # none does: no split step comes
    assert split_decode_rows(1, splitting_below(33)) == 1
