"""CUDA graphs of decode steps: per batch-size bucket, one of the forward and one per sampling
variant.

A step whose sequences each have one query row launches the same kernels whatever its context
lengths, block tables or carried tokens, as long as it reads all of them from device memory:
one fixed device slot (the runner copies each step's inputs into it from its own slot's
device buffers, and the outputs back) and the last step's sampled ids. So the step body is
captured once per bucket and replayed: a step of ``n`` sequences replays the smallest bucket
of at least ``n`` rows. One replay costs a few microseconds of host time instead of a launch
per kernel, which for an 8B model at batch 32 was most of the step (docs/PERFORMANCE.md). One
set serves every slot: capturing one per slot tripled the capture time at start-up for two
copies of a few kilobytes a step.

The body is two graphs: the forward (carry-over and the model, up to the logits), once per
bucket, and the sampling (and writing the outputs), once per bucket and variant, reading the
forward graph's outputs; a replay launches the pair. Capturing is the host's Python running
each body (twice: once uncaptured, then under capture), and the forward is nearly all of it,
so capturing it once per bucket rather than once per variant halved the capture
(docs/PERFORMANCE.md) for one more graph launch a step.

The variants are greedy and temperature-only sampling at every bucket, and the full sampler
(``SamplingMode.FULL``: penalties, logit bias, min_p, top-k, top-p) at coarser buckets
(``full_bucket_sizes``: powers of two from 8, and the largest), each with and without the top
alternatives and with and without the sort that top-k and top-p need: four full variants at
six of the 19 buckets of ``--max-num-seqs 256``, so 62 sampling graphs instead of 38.
Steps with prompt log-probabilities run eagerly.

Mixed steps (decode rows beside prefill chunks, as a server under arrivals runs them all the
time) have graphs of their own (``MixedGraphs``), per bucket of token rows: their launches
depend on the rows, the most sequences and the most chunks a bucket holds, never on the
step's make-up, which the forward reads from the device slot. Eager, such a step's launches
took twice its kernels' time (docs/PERFORMANCE.md, session 35). Larger mixed steps, steps of
more chunks and FULL-sampled ones run eagerly.

Without a CUDA stream (the CPU, in tests) nothing is captured: a "graph" is the pair of
halves bound to their fixed sizes and called again at every replay, so the padding logic
runs in CI too.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, Protocol, TypeVar

import torch
from transformers import PreTrainedModel

from cbpipe.collector import collector_paused
from cbpipe.protocol.messages import SamplingMode, Step

SlotT = TypeVar("SlotT")
T = TypeVar("T")


class Replayable(Protocol):
    def replay(self) -> None: ...


class _BoundPair:
    """The CPU stand-in for a pair of graphs: both halves with their sizes fixed."""

    def __init__(
        self, forward: Callable[[], ForwardOutputs], sample: Callable[[ForwardOutputs], None]
    ) -> None:
        self._forward, self._sample = forward, sample

    def replay(self) -> None:
        self._sample(self._forward())


class _GraphPair:
    """A bucket's forward graph and one variant's sampling graph, which reads its outputs."""

    def __init__(self, forward: torch.cuda.CUDAGraph, sample: torch.cuda.CUDAGraph) -> None:
        self.forward, self.sample = forward, sample

    def replay(self) -> None:
        self.forward.replay()
        self.sample.replay()


class GraphVariant(NamedTuple):
    """How a decode body samples: the mode, and for FULL whether it returns the top
    alternatives and whether it sorts the rows for top-k and top-p."""

    sampling: SamplingMode
    top_logprobs: bool = False
    truncation: bool = False

    @property
    def label(self) -> str:
        """For logs: greedy, temperature, full, full+top-k/top-p+alternatives, ..."""
        if self.sampling is not SamplingMode.FULL:
            return "greedy" if self.sampling is SamplingMode.GREEDY else "temperature"
        truncation = "+top-k/top-p" if self.truncation else ""
        return f"full{truncation}{'+alternatives' if self.top_logprobs else ''}"


@dataclasses.dataclass
class CaptureTimes:
    """Where the captures' time went (the first runs, which compile, excluded), for the log."""

    uncaptured_runs_s: float = 0.0  # each body once before its capture: host time
    waits_s: float = 0.0  # for the device to finish an uncaptured run
    captured_runs_s: float = 0.0  # each body under capture: host time, no device work
    instantiations_s: float = 0.0  # ``capture_end``: the graph made executable

    def describe(self) -> str:
        return (
            f"uncaptured runs {self.uncaptured_runs_s:.2f} s, waits {self.waits_s:.2f} s, "
            f"captured runs {self.captured_runs_s:.2f} s, "
            f"instantiations {self.instantiations_s:.2f} s"
        )


# What the forward half of a decode body gives its sampling half (logits, rows, ids, ...).
ForwardOutputs = tuple[torch.Tensor, ...]
DecodeForward = Callable[[SlotT, int], ForwardOutputs]  # (slot, batch size)
DecodeSampling = Callable[[SlotT, int, GraphVariant, ForwardOutputs], None]


GREEDY = GraphVariant(SamplingMode.GREEDY)
RANDOM = GraphVariant(SamplingMode.RANDOM)
FULL_VARIANTS = tuple(
    GraphVariant(SamplingMode.FULL, top, truncation)
    for top in (False, True)
    for truncation in (False, True)
)
# A mixed graph's FULL variant samples nothing: it hands its logits to the full sampler, which
# runs eagerly after the replay (it counts every chunk row's tokens for the penalties, and
# its sizes follow the step's sequences).
LOGITS_HANDOFF = GraphVariant(SamplingMode.FULL)
MIXED_VARIANTS = {
    SamplingMode.GREEDY: GREEDY,
    SamplingMode.RANDOM: RANDOM,
    SamplingMode.FULL: LOGITS_HANDOFF,
}  # a mixed step's sampling mode -> its graph's variant


def capture_blocker(model: PreTrainedModel) -> str | None:
    """Why ``model``'s decode steps cannot be captured in a CUDA graph, or None.

    Mixture-of-experts layers on transformers' ``grouped_mm`` experts run torch's grouped
    matrix product, which has a CUDA kernel for bfloat16 only; in other dtypes torch falls back
    to a loop over the groups that reads their offsets back to the host, which a capture
    refuses. Such a model decodes eagerly (same tokens, slower steps).
    """
    implementation = getattr(model.config, "_experts_implementation", None)
    has_experts = any(type(m).__name__.endswith("Experts") for m in model.modules())
    if has_experts and implementation == "grouped_mm" and model.dtype != torch.bfloat16:
        return (
            f"its experts run torch's grouped_mm, which in "
            f"{str(model.dtype).removeprefix('torch.')} "
            "reads group offsets back to the host"
        )
    return None


def bucket_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: fine steps where padding costs most, coarser further up.

    Padding a decode step costs little (it is bound by reading the weights), so at most
    about an eighth of a large batch is padding.
    """
    sizes = [1, 2, 4, 8]
    size, stride = 16, 8
    while size < max_batch:
        sizes.append(size)
        if size >= 8 * stride:
            stride *= 2
        size += stride
    sizes.append(max_batch)
    return sorted({s for s in sizes if s <= max_batch})


_MIN_FULL_BUCKET = 8


def full_bucket_sizes(batch_sizes: Sequence[int]) -> list[int]:
    """The full sampler's buckets: the powers of two from 8 among ``batch_sizes``, and the
    largest. Padding a decode step costs little (it reads the weights either way), and each
    bucket is four more graphs."""
    largest = max(batch_sizes)
    powers = {b for b in batch_sizes if b >= _MIN_FULL_BUCKET and b & (b - 1) == 0}
    return sorted(powers | {largest})


# Inductor writes each compiled kernel for the sizes of the first call (they become its size
# hints, and the sizes its reductions are timed at); with dynamic shapes every later batch
# reuses both. Capture runs the largest bucket first, so the kernels were fitted to 256 rows:
# the 8B rotary kernel of q got 256-row tiles that a step at batch 32 ran with 7/8 of every
# tile masked. Tiles fitted to a middling batch waste little at larger ones (more programs,
# all full), where tiles fitted to the largest waste most at the small batches that long
# generations run at. (Element-wise tiles are no longer timed at all:
# ``compiling._COMPILE_OPTIONS``.)
_TUNING_BATCH = 32


def tuning_batch(batch_sizes: Sequence[int]) -> int:
    """The bucket a compiled decode body should first run at: the smallest of at least
    ``_TUNING_BATCH`` rows, or the largest there is."""
    return next((b for b in sorted(batch_sizes) if b >= _TUNING_BATCH), max(batch_sizes))


def compiled_bucket_sizes(batch_sizes: Sequence[int]) -> list[int]:
    """``batch_sizes`` for a compiled decode body: without 1 where there is a larger bucket.

    Dynamo specialises every dimension of size 1, dynamic shapes or not, so a bucket of one
    row would compile the whole forward and its samplers a second time, at start-up. A step of
    one sequence replays the bucket of two instead, with a padding row: a decode step reads
    the weights either way.
    """
    ordered = sorted(batch_sizes)
    return ordered[1:] if len(ordered) > 1 and ordered[0] == 1 else ordered


class DecodeGraphs:
    def __init__(self) -> None:
        self._graphs: dict[tuple[int, GraphVariant], Replayable] = {}
        self.batch_sizes: list[int] = []
        self.full_batch_sizes: list[int] = []
        # The uncaptured run of each variant at ``first_batch``: a compile, if any (the first
        # variant's includes the forward's).
        self.first_run_s: dict[GraphVariant, float] = {}
        self.capture_times = CaptureTimes()
        # The memory pool of the captures, which the mixed steps' graphs share: a pair
        # replays alone, so graphs of one pool never run at once.
        self.pool: object | None = None

    def __len__(self) -> int:
        return len(self._graphs)

    def __iter__(self) -> Iterator[Replayable]:
        return iter(self._graphs.values())

    def capture(
        self,
        forward: DecodeForward[SlotT],
        sample: DecodeSampling[SlotT],
        *,
        batch_sizes: Sequence[int],
        slot: SlotT,
        stream: torch.cuda.Stream | None,
        first_batch: int | None = None,
        full_sampling: bool = True,
        after_first_run: Callable[[], None] | None = None,
    ) -> None:
        """Capture ``forward`` for every bucket and ``sample`` for every bucket and variant on
        ``slot``, largest bucket first to share one pool.

        Each is run once before capture, so lazy initialisation (Triton compilation, cuBLAS
        workspaces) happens outside the graph. The device input buffers hold zeros then
        (``num_seqs`` 0), so every row is padding and no cache block is touched.
        ``first_batch``: run the forward and every variant's sampling at this batch before
        any other, uncaptured, for what sets itself up on the first call's sizes.
        ``full_sampling``: also the full sampler's variants (without: FULL steps run eagerly).
        ``after_first_run``: called after the first variant's run at ``first_batch`` (the
        forward's compile, counted in that variant's time), before the others'.
        """
        self.batch_sizes = sorted(batch_sizes)
        self.full_batch_sizes = full_bucket_sizes(batch_sizes) if full_sampling else []
        full_variants = FULL_VARIANTS if full_sampling else ()
        variants = {batch: [GREEDY, RANDOM] for batch in self.batch_sizes}
        for batch in self.full_batch_sizes:
            variants[batch] = variants.get(batch, []) + list(full_variants)
        if first_batch is not None:
            self._first_runs(
                forward, sample, slot, stream, first_batch, full_variants, after_first_run
            )
        buckets = sorted(variants, reverse=True)
        if stream is None:
            for batch in buckets:
                bound_forward = functools.partial(forward, slot, batch)
                for variant in variants[batch]:
                    bound_sample = functools.partial(sample, slot, batch, variant)
                    self._graphs[batch, variant] = _BoundPair(bound_forward, bound_sample)
            return
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs.update(
            _capture_pairs(forward, sample, variants, slot, stream, self.pool, self.capture_times)
        )

    def _first_runs(
        self,
        forward: DecodeForward[SlotT],
        sample: DecodeSampling[SlotT],
        slot: SlotT,
        stream: torch.cuda.Stream | None,
        batch: int,
        full_variants: Sequence[GraphVariant],
        after_first_run: Callable[[], None] | None,
    ) -> None:
        """One forward at ``batch``, and every variant's sampling of its outputs, timed."""
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            started = time.perf_counter()
            outputs = forward(slot, batch)
            for variant in (GREEDY, RANDOM, *full_variants):
                sample(slot, batch, variant, outputs)
                if stream is not None:
                    stream.synchronize()
                self.first_run_s[variant] = time.perf_counter() - started
                if variant is GREEDY and after_first_run is not None:
                    after_first_run()
                started = time.perf_counter()

    def find(self, step: Step, *, truncation: bool = False) -> Replayable | None:
        """The graph that runs ``step``, or None if it must run eagerly.

        ``truncation``: some sequence of a FULL step has top-k or top-p (the worker reads it
        from the slot; the step message does not say).
        """
        if not self._graphs or not step.is_decode_only:
            return None
        if step.prompt_logprobs:
            return None
        if step.sampling is SamplingMode.FULL:
            sizes = self.full_batch_sizes  # none: FULL steps run eagerly
            variant = GraphVariant(SamplingMode.FULL, step.top_logprobs, truncation)
        else:
            sizes = self.batch_sizes
            variant = GREEDY if step.sampling is SamplingMode.GREEDY else RANDOM
        index = bisect.bisect_left(sizes, step.num_seqs)  # the smallest that fits
        if index == len(sizes):
            return None
        return self._graphs[sizes[index], variant]


# A mixed graph's size: its token rows. Mixed steps are bound by their launches up to some
# hundreds of rows for an 8B model and a few thousand for a 1B one (docs/PERFORMANCE.md);
# past that their kernels hide the launches, and padding would only add work.
MIXED_BUCKET_STRIDES = ((256, 32), (1024, 64), (None, 128))  # up to N rows: every M
# Prefill chunks a mixed graph takes: each is a row of its prefill kernel's grid, and a step
# under arrivals brings one or two.
MAX_GRAPH_CHUNKS = 8


def mixed_bucket_sizes(max_tokens: int) -> list[int]:
    """Token rows to capture mixed steps at, up to ``max_tokens``: every 32 rows up to 256,
    every 64 up to 1024, every 128 from there, and ``max_tokens`` itself."""
    sizes, size = [], 0
    for limit, stride in MIXED_BUCKET_STRIDES:
        while size + stride <= min(limit or max_tokens, max_tokens):
            size += stride
            sizes.append(size)
    return sorted(set(sizes) | {max_tokens}) if max_tokens > 0 else []


def split_decode_rows(seqs: int, decode_splits: Callable[[int], int]) -> int:
    """The most decode rows, up to ``seqs``, that a step can have and still split their
    keys (``decode_splits`` of that many is over 1; it falls as rows grow); at least 1."""
    low, high = 1, seqs
    while low < high:
        middle = (low + high + 1) // 2
        if decode_splits(middle) > 1:
            low = middle
        else:
            high = middle - 1
    return low


class MixedShape(NamedTuple):
    """What fixes a mixed graph's launches: its token rows, and whether its decode rows'
    keys are split (a few decodes, which leave SMs idle unsplit) or not (decodes enough to
    cover the SMs: splits would only add merge work)."""

    rows: int
    split: bool


class MixedGraphs:
    """CUDA graphs of mixed steps: per bucket of token rows, two forwards (split and unsplit
    decode keys) and one sampling graph per forward and variant (greedy, temperature, and
    ``LOGITS_HANDOFF`` for steps that sample FULL), in ``DecodeGraphs``' pool.

    A forward covers its rows, as many sequences (up to the slots' most: its logits' and
    samplers' rows) and ``MAX_GRAPH_CHUNKS`` prefill chunks; which rows and sequences are
    real, which are decodes and where the chunks start come from the device slot.
    """

    def __init__(self) -> None:
        self._graphs: dict[tuple[MixedShape, GraphVariant], Replayable] = {}
        self.token_sizes: list[int] = []
        self.capture_times = CaptureTimes()

    def __len__(self) -> int:
        return len(self._graphs)

    def capture(
        self,
        forward: Callable[[SlotT, MixedShape], ForwardOutputs],
        sample: Callable[[SlotT, MixedShape, GraphVariant, ForwardOutputs], None],
        *,
        token_sizes: Sequence[int],
        slot: SlotT,
        stream: torch.cuda.Stream | None,
        pool: object | None,
    ) -> None:
        """Capture ``forward`` per shape (each of ``token_sizes``, split and unsplit) and
        ``sample`` per shape and variant; on the CPU, bind them as ``DecodeGraphs`` does."""
        self.token_sizes = sorted(token_sizes)
        shapes = [MixedShape(rows, split) for rows in self.token_sizes for split in (False, True)]
        variants = {shape: list(MIXED_VARIANTS.values()) for shape in shapes}
        if stream is None:
            for shape in shapes:
                for variant in variants[shape]:
                    self._graphs[shape, variant] = _BoundPair(
                        functools.partial(forward, slot, shape),
                        functools.partial(sample, slot, shape, variant),
                    )
            return
        self._graphs.update(
            _capture_pairs(forward, sample, variants, slot, stream, pool, self.capture_times)
        )

    def eager_reason(self, step: Step) -> str | None:
        """Why ``step`` runs eagerly rather than from a mixed graph, or None if one runs it."""
        num_chunks = step.num_seqs - step.num_single_token_seqs
        if num_chunks == 0:
            return "decodes only (the decode graphs' step)"
        if not self.token_sizes:
            return "no mixed graphs"
        if num_chunks > MAX_GRAPH_CHUNKS:
            return f"{num_chunks} prefill chunks, more than a graph's {MAX_GRAPH_CHUNKS}"
        if step.prompt_logprobs:
            return "prompt log-probabilities"
        if step.num_tokens > self.token_sizes[-1]:
            return f"{step.num_tokens} rows, more than the largest graph's {self.token_sizes[-1]}"
        return None

    def find(self, step: Step, *, split: bool) -> Replayable | None:
        """The graph that runs mixed ``step`` (``split``: with its decode keys split), or
        None: it runs eagerly (``eager_reason`` says why). A FULL step's graph runs the
        forward only and leaves the sampling to the caller (``LOGITS_HANDOFF``)."""
        if self.eager_reason(step) is not None:
            return None
        index = bisect.bisect_left(self.token_sizes, step.num_tokens)
        shape = MixedShape(self.token_sizes[index], split)
        return self._graphs[shape, MIXED_VARIANTS[step.sampling]]


K = TypeVar("K", int, MixedShape)


def _capture_pairs(
    forward: Callable[[SlotT, K], ForwardOutputs],
    sample: Callable[[SlotT, K, GraphVariant, ForwardOutputs], None],
    variants: dict[K, list[GraphVariant]],
    slot: SlotT,
    stream: torch.cuda.Stream,
    pool: object,
    times: CaptureTimes,
) -> dict[tuple[K, GraphVariant], Replayable]:
    """Each size's forward graph and its variants' sampling graphs, largest size first."""
    graphs: dict[tuple[K, GraphVariant], Replayable] = {}
    # After the first runs, which compile and make garbage; see ``collector_paused``.
    with collector_paused():
        for size in sorted(variants, reverse=True):
            forward_graph, outputs = _capture(
                functools.partial(forward, slot, size), stream, pool, times
            )
            # The outputs are the pool's while the sampling graphs that read them are
            # captured, then free for the next sizes' graphs: a pair replays alone.
            with torch.cuda.stream(stream):
                forward_graph.replay()  # values for the samplers' uncaptured runs
            for variant in variants[size]:
                sample_graph, _ = _capture(
                    functools.partial(sample, slot, size, variant, outputs), stream, pool, times
                )
                graphs[size, variant] = _GraphPair(forward_graph, sample_graph)
            del outputs
        torch.cuda.synchronize()
    return graphs


def _capture(
    body: Callable[[], T], stream: torch.cuda.Stream, pool: object, times: CaptureTimes
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``body`` once uncaptured (lazy initialisation happens there, outside the graph),
    then capture it on ``stream`` into ``pool``; the graph and what the captured run
    returned (tensors of the pool, which each replay writes).

    Not through ``torch.cuda.graph``: entering it empties the allocator's caches, device and
    host, to free memory for the graph, so each of a few hundred captures freed what the
    uncaptured run had just allocated and the next run allocated it again. The graphs share
    one pool, and the uncaptured runs' memory is the same few blocks each time.
    """
    started = time.perf_counter()
    with torch.cuda.stream(stream):
        body()
    ran = time.perf_counter()
    stream.synchronize()
    waited = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        # Thread-local: a checkpoint's weights may be arriving from another thread
        # (``model_loader.PendingWeights``), whose copies would end a global capture.
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            result = body()
        except BaseException:
            with contextlib.suppress(RuntimeError):  # the capture is invalid: end it anyway
                graph.capture_end()
            raise
        captured = time.perf_counter()
        graph.capture_end()
    times.uncaptured_runs_s += ran - started
    times.waits_s += waited - ran
    times.captured_runs_s += captured - waited
    times.instantiations_s += time.perf_counter() - captured
    return graph, result
