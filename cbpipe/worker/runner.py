"""Runs one step: copy in, carry over, forward, sample, copy out, on three streams.

Slot ownership on the worker side (the scheduler's side is in ``scheduler/loop.py``):

- The host input region of slot k is the worker's from the ``Step`` message until the H2D copy
  that reads it completes; the worker never reads it after that.
- The device input buffer of slot k is written by the H2D copy only after the compute of the
  step that last used slot k is done (``compute_done[k]``).
- The device output buffer of slot k is written by sampling only after the D2H copy of the
  step that last used it is done (``d2h_done[k]``).
- ``last_sampled`` (device) is written by every step's sampling and read by the next step's
  carry-over; both run on the compute stream, in launch order, and the scheduler only ever
  carries over from the step it sent just before (checked against ``carry_from_slot``).
- The host output region of slot k is written by the D2H copy; ``StepDone`` is sent only after
  ``d2h_done[k]`` has completed, and from then on it is the scheduler's.
- With tensor parallelism every rank reads the same host input region and only rank 0
  writes the host output region and sends ``StepDone``. Rank 0's step N ends after its last
  collective, which no rank enters before its own H2D copy of step N is done: so when the
  scheduler rewrites a slot after ``StepDone``, no rank still reads it.

On the CPU the streams and events are absent and each call runs to completion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from transformers import PreTrainedModel

from cbpipe.protocol.messages import SamplingMode, Step, StepDone
from cbpipe.protocol.sampling import MAX_TOP_LOGPROBS
from cbpipe.protocol.slots import (
    HEADER_FIELDS,
    REGIONS,
    SlotLayout,
    StepInputs,
    numpy_views,
)
from cbpipe.worker.attention import (
    DecodeGraphStep,
    DecodeKernel,
    KVCache,
    ModelAttention,
    OpaqueStep,
    PagedStep,
    PrefillKernel,
    StepAttention,
)
from cbpipe.worker.blas import BlasLibraries, products_on, warm_product_plans
from cbpipe.worker.compiled_layers import compile_layers
from cbpipe.worker.compiling import (
    compile_decode_fn,
    compile_phases,
    decode_compile_settings,
    dynamo_graphs,
)
from cbpipe.worker.cuda_graphs import (
    LOGITS_HANDOFF,
    MAX_GRAPH_CHUNKS,
    DecodeGraphs,
    ForwardOutputs,
    GraphVariant,
    MixedGraphs,
    MixedShape,
    Replayable,
    capture_blocker,
    compiled_bucket_sizes,
    mixed_bucket_sizes,
    split_decode_rows,
    tuning_batch,
)
from cbpipe.worker.kernels.paged_decode import launch_grid
from cbpipe.worker.sampler import prompt_logprobs
from cbpipe.worker.sampling_state import SamplingState
from cbpipe.worker.saved_traces import SavedTraces
from cbpipe.worker.step_sampling import DeviceSlot, StepSampling, device_slot, real_rows

log = logging.getLogger(__name__)

_NUM_TOKENS = HEADER_FIELDS.index("num_tokens")
_NUM_SEQS = HEADER_FIELDS.index("num_seqs")
_WIDTH = HEADER_FIELDS.index("block_table_width")


def _graph_hands_off_logits(step: Step) -> bool:
    """Whether the graph that runs ``step`` leaves its sampling to an eager full sampler: a
    mixed step's that samples FULL (``LOGITS_HANDOFF``); the decode graphs sample every mode."""
    return step.sampling is SamplingMode.FULL and not step.is_decode_only


@dataclass
class SlotBuffers(DeviceSlot):
    """One slot's shared host regions and their device copies."""

    host_input: torch.Tensor  # uint8 views of the shared slot's regions
    host_extras: torch.Tensor
    host_output: torch.Tensor
    header: np.ndarray  # host header, read to check the slot holds the announced step
    # The host input region as numpy arrays: the worker reads a few per-sequence fields of
    # FULL and prompt log-probability steps there (``StepFacts``), before the H2D copy.
    host_inputs: StepInputs[np.ndarray]


class StepFacts(NamedTuple):
    """What the launch of a step reads from the host slot (which is the worker's from the
    step message until its H2D copy), to size its device work without reading device
    memory: for any step its restarts, for FULL and prompt log-probability steps more."""

    num_restarts: int = 0  # sequences that took their request row: its state is cleared
    truncation: bool = False  # some sequence has top-k or top-p: the sampler sorts
    num_logits_rows: int = 0  # with prompt log-probabilities: rows that need logits


def logits_width(model: PreTrainedModel) -> int:
    """Logits per row: the output embedding's rows (the configuration's vocabulary)."""
    head = model.get_output_embeddings()
    if head is not None:
        # A tensor-parallel head holds a slice of the rows and gathers the whole width.
        return int(getattr(head, "full_out_features", head.weight.shape[0]))
    return int(model.config.get_text_config().vocab_size)


class DeviceClock:
    """Places CUDA events on the host's ``perf_counter_ns`` clock.

    A reference event is recorded on an idle device and waited for; an event's host time is
    then the reference's host time plus the device time between the two. The error is the
    latency of that one wait (microseconds), and the clocks drift by parts per million.
    """

    def __init__(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
        self.reference = torch.cuda.Event(enable_timing=True)
        self.reference.record(torch.cuda.current_stream(device))
        self.reference.synchronize()
        self.reference_ns = time.perf_counter_ns()

    def host_ns(self, event: torch.cuda.Event) -> int:
        return self.reference_ns + int(self.reference.elapsed_time(event) * 1e6)


class AllocatorDelta(NamedTuple):
    """What the caching allocator did between two checks."""

    retries: int  # requests its cache could not serve: it freed the cache and asked again
    device_allocations: int  # memory it asked CUDA for (cudaMalloc)


class AllocatorWatch:
    """The caching allocator's retries and device allocations since the runner was ready.

    A request that its cached blocks cannot serve makes it free them all, which synchronises
    the device, and ask CUDA again: the host stalls inside the launch that asked, and the
    device runs dry behind it. A request it has no free cached block for asks CUDA for more
    memory, which takes the host longer than a cached block does.
    """

    def __init__(self, read_stats: Callable[[], Mapping[str, int]]) -> None:
        self._read_stats = read_stats
        self._last = self._read()
        self.since_ready = 0  # retries

    def _read(self) -> AllocatorDelta:
        stats = self._read_stats()
        return AllocatorDelta(
            int(stats.get("num_alloc_retries", 0)), int(stats.get("num_device_alloc", 0))
        )

    def check(self) -> AllocatorDelta:
        """What it did since the last check."""
        now = self._read()
        new = AllocatorDelta(*(a - b for a, b in zip(now, self._last, strict=True)))
        self._last = now
        self.since_ready += new.retries
        return new


def collections_so_far() -> int:
    """The garbage collector's collections in this process, of every generation."""
    return sum(generation["collections"] for generation in gc.get_stats())


@dataclass
class LaunchedStep:
    """A step whose work is enqueued; ``wait()`` blocks until its outputs are in shared memory.

    On the CPU the work is already done and the compute span is given in host time.
    """

    step: Step
    recv_ns: int
    launched_ns: int
    d2h_done: torch.cuda.Event | None = None
    compute_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    clock: DeviceClock | None = None
    compute_ns: tuple[int, int] = (0, 0)

    def wait(self) -> StepDone:
        start_ns, end_ns = self.compute_ns
        if self.d2h_done is not None and self.compute_events is not None:
            assert self.clock is not None
            self.d2h_done.synchronize()
            start_ns, end_ns = (self.clock.host_ns(e) for e in self.compute_events)
        return StepDone(
            self.step.step,
            self.step.slot,
            self.recv_ns,
            start_ns,
            end_ns,
            launched_ns=self.launched_ns,
            reported_ns=time.perf_counter_ns(),
        )


class StepRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        attention: ModelAttention,
        kv_cache: KVCache,
        layout: SlotLayout,
        segment: memoryview,
        device: torch.device,
        *,
        decode_kernel: DecodeKernel | None = None,
        prefill_kernel: PrefillKernel | None = None,
        graph_batch_sizes: Sequence[int] = (),
        compile_decode: bool = False,
        sampling_state: SamplingState | None = None,
        full_sampling_graphs: bool = True,
        writes_outputs: bool = True,
        before_sampler_compiles: Callable[[], None] | None = None,
        saved_traces: SavedTraces | None = None,
        max_batch_tokens: int | None = None,
        max_num_seqs: int | None = None,
        blas: BlasLibraries | None = None,
        mixed_graph_tokens: int = 0,
    ) -> None:
        """``attention``: the model's layers as the load-time probe found them, and the binding
        through which each step's attention reaches them.

        ``graph_batch_sizes``: decode batch sizes to capture CUDA graphs for (none: eager).

        On the CPU they are not captured but run as the same fixed-size body (for tests).
        ``compile_decode``: run the decoder layers through ``torch.compile``, which fuses the
        small element-wise kernels between the matrix products and the attention op: the
        decode graphs' forward, and eager steps of two rows or more (prefill chunks beside
        decodes), which then launch a few kernels a layer instead of dozens.
        ``sampling_state``: the per-request rows of the full sampler; the worker allocates it
        before sizing the KV cache, and a runner without one allocates its own.
        ``full_sampling_graphs``: capture the full sampler's decode variants too (without:
        FULL steps run eagerly; for measuring what they cost).
        ``writes_outputs``: copy each step's outputs into the shared slot. Only tensor-parallel
        rank 0 does; the other ranks compute the same outputs (they need the sampled ids for
        the carry-over) and keep them on the device.
        ``before_sampler_compiles``: called once the compiled forward has run, before the
        samplers' first runs (the worker waits there for the samplers compiled ahead).
        ``saved_traces``: where the compiled samplers' saved traces are loaded from.
        ``max_batch_tokens``: the scheduler's per-step token budget, which the warm-up's
        prefills reach (default: the slots' capacity).
        ``max_num_seqs``: the most sequences the scheduler puts in a step, which the sampler's
        rows, the graphs and the warm-up cover (default: the slots' capacity).
        ``blas``: the BLAS libraries ``use_blas_library`` set up; eager steps run their
        products on its eager one (None: on the process's setting).
        ``mixed_graph_tokens``: with decode graphs and both Triton kernels, also capture
        mixed steps (decodes beside prefill chunks) of up to this many token rows
        (``MixedGraphs``); 0: they run eagerly.
        """
        started = time.perf_counter()
        self.writes_outputs = writes_outputs
        self.model = model
        self.attention = attention
        self.kv_cache = kv_cache
        self.layout = layout
        self.max_batch_tokens = max_batch_tokens or layout.limits.max_tokens
        if self.max_batch_tokens > layout.limits.max_tokens:
            raise ValueError(
                f"a budget of {self.max_batch_tokens} tokens a step in slots of "
                f"{layout.limits.max_tokens}"
            )
        self.max_num_seqs = max_num_seqs or layout.limits.max_seqs
        if self.max_num_seqs > layout.limits.max_seqs:
            raise ValueError(
                f"{self.max_num_seqs} sequences a step in slots of {layout.limits.max_seqs}"
            )
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda and graph_batch_sizes and (blocker := capture_blocker(model)) is not None:
            log.warning("decode steps run without CUDA graphs: %s", blocker)
            graph_batch_sizes, compile_decode = (), False
        host = torch.frombuffer(segment, dtype=torch.uint8, count=layout.segment_nbytes)
        self.slots = [self._slot_buffers(host, k) for k in range(layout.num_slots)]
        # What the decode graphs read and write, whichever slot a step came in: its inputs
        # are copied in before a replay and the outputs back after it.
        self.graph_slot = device_slot(layout, device) if graph_batch_sizes else None
        self.h2d_stream = torch.cuda.Stream(device) if self.cuda else None
        self.compute_stream = torch.cuda.Stream(device) if self.cuda else None
        self.d2h_stream = torch.cuda.Stream(device) if self.cuda else None
        num_slots = layout.num_slots
        self.compute_done = [self._event() for _ in range(num_slots)]
        self.d2h_done = [self._event() for _ in range(num_slots)]
        self.clock = DeviceClock(device) if self.cuda else None
        self._last_d2h: torch.cuda.Event | None = None  # the last launched step's outputs copied
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        # Only a library other than the process's own is switched to around eager steps,
        # so a runner of one library asks torch nothing a step.
        self._eager_blas = blas.eager if blas is not None and blas.eager != blas.graphs else None
        # Where this runner's set-up went, in order, for the worker's start-up line.
        self.startup_seconds: dict[str, float] = {"slots": time.perf_counter() - started}
        # Dynamic shapes and the opaque attention op (``OpaqueStep``) give one compiled graph
        # of each decoder layer for every bucket and every eager step's make-up.
        started = time.perf_counter()
        self._compiled_model = compile_layers(model, compile_decode_fn) if compile_decode else None
        self.startup_seconds["layers wrapped"] = time.perf_counter() - started
        self.vocab = logits_width(model)
        if sampling_state is None:
            sampling_state = SamplingState.allocate(self.max_num_seqs, self.vocab, device)
        if sampling_state.vocab != self.vocab:
            raise ValueError(
                f"sampling state for {sampling_state.vocab} tokens, model of {self.vocab}"
            )
        # Sampling too compiles in graphs (every variant at capture), never in eager steps.
        self.sampling = StepSampling(
            sampling_state, self.max_num_seqs, device, compiled=compile_decode, saved=saved_traces
        )
        self._row_ids = torch.arange(self.max_num_seqs, device=device)
        limits = layout.limits
        # Row, sequence, chunk and block-table indices of the mixed graphs' forwards.
        self._indices = torch.arange(
            max(limits.max_tokens, limits.max_blocks_per_seq, MAX_GRAPH_CHUNKS + 1),
            device=device,
        )
        self.mixed_graphs = MixedGraphs()
        # The logits a FULL mixed step's graph hands to the eager full sampler: outside the
        # graphs' pool, whose memory the next replay reuses; allocated by the first capture.
        self._mixed_logits: torch.Tensor | None = None
        self._mixed_graph_tokens = min(mixed_graph_tokens, self.max_batch_tokens)
        if prefill_kernel is None:
            self._mixed_graph_tokens = 0  # the torch path's launches follow the make-up
        self._last_slot: int | None = None
        self.graphs = DecodeGraphs()
        self._before_sampler_compiles = before_sampler_compiles
        if graph_batch_sizes and decode_kernel is None:
            raise ValueError("decode graphs need the Triton decode kernel")
        self._registered_ptr: int | None = None
        if self.cuda:
            started = time.perf_counter()
            # Page-lock the shared segment so copies to and from it are asynchronous DMA.
            status = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister failed with status {status}")
            self._registered_ptr = host.data_ptr()
            self.startup_seconds["host registration"] = time.perf_counter() - started
        self._allocator: AllocatorWatch | None = None
        self._collections_seen = 0  # the garbage collector's, at the last launch line
        try:
            if graph_batch_sizes:
                self._capture_graphs(graph_batch_sizes, full_sampling_graphs)  # warms up too
            else:
                self._warm_up_kernels()
        except BaseException:
            # A failed start (a graph that cannot be captured) must not leave the segment
            # registered: a later segment mapped at the same address would fail to register.
            self.close()
            raise
        if self.cuda:
            self._allocator = AllocatorWatch(lambda: torch.cuda.memory_stats(device))
            self._collections_seen = collections_so_far()

    @property
    def compiled(self) -> bool:
        """Whether the decoder layers run compiled (``compile_decode``)."""
        return self._compiled_model is not None

    def _warm_up_kernels(self) -> None:
        if self.cuda and (self.decode_kernel is not None or self.prefill_kernel is not None):
            self.warm_up()

    def warm_up(self) -> None:
        """Run eager steps of every shape class a server meets, before it serves.

        Triton compiles a kernel on the host the first time a launch needs a new variant
        (tile sizes follow the longest query; whether a decode splits its keys follows the
        batch size; arguments that change between steps are not specialised, see
        ``kernels.jit.jit_varying``), for a second or more each: in an H200 run the first
        prefill steps took 1.3-1.7 s instead of 70 ms, with the device idle. So each eager
        step's variants are met here: one decode row beside a prefill of every power-of-two
        length up to the step's token budget, and decode-only steps of every power-of-two
        batch up to the slots' width, greedy; then the sampled and fully processed samplers
        once each (``StepSampling.warm_up_eager``). The steps read and write only the
        cache's padding block, through slot 0's own buffers, and nothing is in flight yet.
        On CUDA the products then run alone at row counts between those lengths
        (``blas.warm_product_plans``): a step's row count is any number up to the budget,
        and the library's kernels for it load the first time it picks them.
        """
        started = time.perf_counter()
        beside = min(1, self.max_num_seqs - 1)  # a decode row beside each prefill
        longest = self.max_batch_tokens - beside
        lengths = sorted({1 << i for i in range(longest.bit_length())} | {longest})
        widest = min(self.max_num_seqs, self.max_batch_tokens)
        # Decode-only batches of every power of two: the split count follows the batch size.
        batches = sorted({1 << i for i in range(widest.bit_length())} | {widest})
        shapes = [(beside, n) for n in lengths] + [(b, 0) for b in batches]
        num_products = 0
        with self._on(self.compute_stream):  # the slot's fills and the steps, in order
            for num_decodes, prefill_len in shapes:
                self._run_padding_step(num_decodes, prefill_len)
            self.sampling.warm_up_eager()
            if self.cuda:
                with products_on(self._eager_blas):
                    num_products = warm_product_plans(
                        self.model, self.max_batch_tokens, self.max_num_seqs
                    )
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.startup_seconds["warm-up"] = time.perf_counter() - started
        log.info(
            "warmed up %d eager step shapes (prefill up to %d tokens) and %d products' plans "
            "in %.1f s",
            len(shapes),
            longest,
            num_products,
            self.startup_seconds["warm-up"],
        )

    def _run_padding_step(self, num_decodes: int, prefill_len: int) -> None:
        """One eager step through slot 0: ``num_decodes`` decode rows, then a prefill of
        ``prefill_len`` tokens, every row writing and reading the cache's padding block."""
        limits = self.layout.limits
        bs = self.kv_cache.block_size
        width = max(1, -(-prefill_len // bs))
        if width > limits.max_blocks_per_seq:
            return  # longer than a sequence may be
        num_seqs = num_decodes + (1 if prefill_len else 0)
        num_tokens = num_decodes + prefill_len
        query_start = list(range(num_decodes + 1)) + ([num_tokens] if prefill_len else [])
        inputs = self.slots[0].inputs
        inputs.header[_WIDTH] = width
        inputs.header[_NUM_SEQS] = num_seqs
        inputs.input_ids[:num_tokens] = 0
        inputs.carry_mask[:num_tokens] = False
        inputs.positions[:num_tokens].copy_(
            torch.tensor([0] * num_decodes + list(range(prefill_len)))
        )
        inputs.slot_mapping[:num_tokens] = self.kv_cache.padding_slot
        inputs.query_start[: num_seqs + 1].copy_(torch.tensor(query_start))
        inputs.context_lens[:num_decodes] = 1
        inputs.context_lens[num_decodes:num_seqs] = prefill_len
        inputs.block_tables[: num_seqs * width] = self.kv_cache.num_blocks  # padding
        inputs.temperature[:num_seqs] = 0.0
        step = Step(
            step=-1,
            slot=0,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            num_single_token_seqs=num_decodes,
            max_query_len=max(prefill_len, 1),
            max_context_len=max(prefill_len, 1),
            block_table_width=width,
            carry_from_slot=None,
            sampling=SamplingMode.GREEDY,
            top_logprobs=False,
            prompt_logprobs=False,
            num_bias_entries=0,
        )
        self._compute(step, self.slots[0])

    def _capture_graphs(self, batch_sizes: Sequence[int], full_sampling: bool) -> None:
        if max(batch_sizes) > self.max_num_seqs:
            raise ValueError(
                f"graph batch sizes {list(batch_sizes)} exceed the {self.max_num_seqs} "
                f"sequences a step holds"
            )
        if self.compiled:
            batch_sizes = compiled_bucket_sizes(batch_sizes)
        else:
            self._warm_up_kernels()
        compiles_before = dynamo_graphs()
        started = time.perf_counter()
        assert self.graph_slot is not None
        with decode_compile_settings():  # where the bodies compile
            self.graphs.capture(
                self._graph_forward,
                self._graph_sample,
                batch_sizes=batch_sizes,
                slot=self.graph_slot,
                stream=self.compute_stream,
                first_batch=tuning_batch(batch_sizes) if self.compiled else None,
                full_sampling=full_sampling,
                after_first_run=self._after_layers_compiled if self.compiled else None,
            )
        elapsed = time.perf_counter() - started
        first_runs = sum(self.graphs.first_run_s.values())  # the compile, if any
        if self.compiled:
            self.startup_seconds["compile"] = first_runs
        warm_up = self.startup_seconds.get("warm-up", 0.0) if self.compiled else 0.0
        self.startup_seconds["capture"] = elapsed - first_runs - warm_up
        log.info(
            "captured %d decode graphs (batch sizes %s, full sampler at %s) in %.1f s%s; "
            "the captures proper: %s",
            len(self.graphs),
            self.graphs.batch_sizes,
            self.graphs.full_batch_sizes,
            elapsed,
            self._compile_summary(compiles_before) if self.compiled else "",
            self.graphs.capture_times.describe(),
        )
        if self.compiled:
            log.info("compile phases, longest first (they nest): %s", compile_phases())
        if self._mixed_graph_tokens:
            self._capture_mixed_graphs()

    def _capture_mixed_graphs(self) -> None:
        started = time.perf_counter()
        assert self.graph_slot is not None
        with decode_compile_settings():
            self.mixed_graphs.capture(
                self._mixed_graph_forward,
                self._mixed_graph_sample,
                token_sizes=mixed_bucket_sizes(self._mixed_graph_tokens),
                slot=self.graph_slot,
                stream=self.compute_stream,
                pool=self.graphs.pool,
            )
        elapsed = time.perf_counter() - started
        self.startup_seconds["mixed capture"] = elapsed
        log.info(
            "captured %d mixed-step graphs (token rows %s, up to %d prefill chunks) in %.1f s",
            len(self.mixed_graphs),
            self.mixed_graphs.token_sizes,
            MAX_GRAPH_CHUNKS,
            elapsed,
        )

    def _after_layers_compiled(self) -> None:
        """Between the layers' compile (the first body's run, at the tuning batch) and the
        samplers' first runs: the warm-up, whose eager steps run the compiled layers as served
        steps do, while the compile-ahead processes finish the samplers; then the wait for
        those processes."""
        self._warm_up_kernels()
        if self._before_sampler_compiles is not None:
            self._before_sampler_compiles()

    def _compile_summary(self, compiles_before: int) -> str:
        """How long the first run of each variant took (its compile), and how many graphs
        dynamo compiled in all: more than at the first runs means a bucket recompiled."""
        each = ", ".join(f"{v.label} {s:.1f}" for v, s in self.graphs.first_run_s.items())
        loaded = self.sampling.loaded_traces()
        return (
            f", compiling their forward and samplers {self.startup_seconds['compile']:.1f} s of it "
            f"({each}), {dynamo_graphs() - compiles_before} dynamo graphs, "
            f"saved sampler traces loaded: {', '.join(loaded) or 'none'}"
        )

    def _event(self, timing: bool = False) -> torch.cuda.Event | None:
        return torch.cuda.Event(enable_timing=timing) if self.cuda else None

    def _slot_buffers(self, host: torch.Tensor, slot: int) -> SlotBuffers:
        layout = self.layout
        base = layout.slot_offset(slot)
        hosts = {}
        for name in REGIONS:
            start, end = layout.region(name)
            hosts[name] = host[base + start : base + end]
        device = device_slot(layout, self.device)
        return SlotBuffers(
            **{f.name: getattr(device, f.name) for f in dataclasses.fields(DeviceSlot)},
            host_input=hosts["inputs"],
            host_extras=hosts["extras"],
            host_output=hosts["outputs"],
            header=hosts["inputs"][: layout.fields["header"].nbytes].numpy().view(np.int64),
            host_inputs=numpy_views(host.numpy().data, layout, slot).inputs,
        )

    @property
    def state(self) -> SamplingState:
        """The full sampler's per-request rows."""
        return self.sampling.state

    @property
    def last_sampled(self) -> torch.Tensor:
        """The sampled ids of the step launched last, which the next step's carry-over reads."""
        return self.sampling.last_sampled

    def recalibrate_clock(self) -> None:
        """Anchor the device clock anew if the device is idle (nothing launched is still
        running); called when no step has come for a while. Host and device clocks drift
        apart by parts per million, which over a compiling start-up of 100 s or more is
        tenths of a millisecond: enough to misplace device spans against the CPU's in a
        trace of 3 ms steps. A step in flight keeps the clock it was launched with."""
        if self.cuda and (self._last_d2h is None or self._last_d2h.query()):
            self.clock = DeviceClock(self.device)

    def close(self) -> None:
        if self._allocator is not None:
            with contextlib.suppress(RuntimeError):  # a device error may answer instead
                self._allocator.check()
            if self._allocator.since_ready:
                log.warning(
                    "the caching allocator ran short %d times while serving: each time it "
                    "freed its cache, which waits for the device, and the step stalled; "
                    "a smaller --kv-cache-memory-fraction leaves it more room",
                    self._allocator.since_ready,
                )
            self._allocator = None
        if self._registered_ptr is not None:
            with contextlib.suppress(RuntimeError):  # a failed capture may have left an error
                torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            self._registered_ptr = None

    def launch(self, step: Step) -> LaunchedStep:
        """Enqueue ``step``; returns at once on CUDA, after the whole step on the CPU."""
        recv_ns = time.perf_counter_ns()
        slot = self.slots[step.slot]
        header = tuple(int(v) for v in slot.header)
        if header != (step.step, step.num_tokens, step.num_seqs, step.block_table_width):
            raise RuntimeError(
                f"slot {step.slot} holds step/tokens/seqs/width {header}, "
                f"but step {step.step} was announced"
            )
        if step.carry_from_slot is not None and step.carry_from_slot != self._last_slot:
            raise RuntimeError(
                f"step {step.step} carries over from slot {step.carry_from_slot}, "
                f"but the step launched last used slot {self._last_slot}"
            )
        if step.top_logprobs and step.sampling is not SamplingMode.FULL:
            raise RuntimeError(f"step {step.step} asks for top alternatives outside FULL mode")
        if step.num_token_masks and step.sampling is not SamplingMode.FULL:
            raise RuntimeError(f"step {step.step} has token masks outside FULL mode")
        self._last_slot = step.slot
        facts = self._step_facts(step, slot)
        graph = self._find_graph(step, facts)
        used = self.layout.input_nbytes_used(step.num_seqs, step.block_table_width)
        k = step.slot
        with self._on(self.h2d_stream):
            self._wait(self.compute_done[k])
            slot.device_input[:used].copy_(slot.host_input[:used], non_blocking=True)
            self._copy_extras(step, slot)
            h2d_done = self._record()

        out_nbytes = self.layout.output_nbytes_used(
            top_logprobs=step.top_logprobs, prompt_logprobs=step.prompt_logprobs
        )
        compute_start, compute_end = self._event(timing=True), self._event(timing=True)
        with self._on(self.compute_stream):
            self._wait(h2d_done)
            self._wait(self.d2h_done[k])
            self._record(compute_start)
            start_ns = time.perf_counter_ns()
            self._prepare_state(step, slot, facts.num_restarts)
            if graph is not None:
                assert self.graph_slot is not None
                self.graph_slot.device_input[:used].copy_(slot.device_input[:used])
                graph.replay()
                if _graph_hands_off_logits(step):
                    self._sample_handed_off_logits(step, slot, facts)
                else:
                    slot.device_output[:out_nbytes].copy_(
                        self.graph_slot.device_output[:out_nbytes]
                    )
            else:
                self._compute(step, slot, facts)
            end_ns = time.perf_counter_ns()
            self._record(compute_end)
            self._record(self.compute_done[k])

        with self._on(self.d2h_stream):
            self._wait(self.compute_done[k])
            if self.writes_outputs:
                host_output = slot.host_output[:out_nbytes]
                host_output.copy_(slot.device_output[:out_nbytes], non_blocking=True)
            self._record(self.d2h_done[k])
        self._last_d2h = self.d2h_done[k]
        launched_ns = time.perf_counter_ns()
        # Reading the allocator's statistics costs more than a small step's launch.
        if self._allocator is not None and log.isEnabledFor(logging.DEBUG):
            self._log_launch(step, (launched_ns - recv_ns) / 1e6, eager=graph is None)
        if not self.cuda:
            return LaunchedStep(step, recv_ns, launched_ns, compute_ns=(start_ns, end_ns))
        assert compute_start is not None and compute_end is not None
        return LaunchedStep(
            step, recv_ns, launched_ns, self.d2h_done[k], (compute_start, compute_end), self.clock
        )

    def _log_launch(self, step: Step, launch_ms: float, *, eager: bool) -> None:
        """At debug level: what may have held up an eager step's launch, or a replay's that
        met one of these: the allocator asking CUDA for memory, or freeing its cache and
        retrying; the garbage collector (its collections since the previous launch)."""
        assert self._allocator is not None
        delta = self._allocator.check()
        seen, self._collections_seen = self._collections_seen, collections_so_far()
        collections = self._collections_seen - seen
        if eager or any(delta) or collections:
            log.debug(
                "step %d (%d rows, %s): launched in %.1f ms; the caching allocator asked CUDA "
                "for memory %d times and freed its cache and retried %d times; %d garbage "
                "collections since the previous launch",
                step.step,
                step.num_tokens,
                "eager" if eager else "from a graph",
                launch_ms,
                delta.device_allocations,
                delta.retries,
                collections,
            )

    def _copy_extras(self, step: Step, slot: SlotBuffers) -> None:
        """The used prefix of each extras field this step reads, host to device."""
        counts = {}
        if step.num_bias_entries:
            for name in ("bias_rows", "bias_token_ids", "bias_values"):
                counts[name] = step.num_bias_entries
        if step.num_token_masks:
            counts["mask_seqs"] = step.num_token_masks
            counts["token_masks"] = step.num_token_masks * self.layout.limits.mask_words
        if step.prompt_logprobs:
            counts["prompt_targets"] = step.num_tokens
        extras_start = self.layout.region("extras")[0]
        for name, count in counts.items():
            f = self.layout.fields[name]
            start = f.offset - extras_start
            end = start + count * f.itemsize
            slot.device_extras[start:end].copy_(slot.host_extras[start:end], non_blocking=True)

    def graph_for(self, step: Step) -> Replayable | None:
        """The graph ``launch`` would replay for ``step`` (packed in its slot), or None."""
        return self._find_graph(step, self._step_facts(step, self.slots[step.slot]))

    def _find_graph(self, step: Step, facts: StepFacts) -> Replayable | None:
        if step.is_decode_only:
            return self.graphs.find(step, truncation=facts.truncation)
        if not len(self.mixed_graphs):
            return None
        graph = self.mixed_graphs.find(
            step, split=self._decode_splits(step.num_single_token_seqs) > 1
        )
        if graph is None and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "step %d (%d rows) runs eagerly: %s",
                step.step,
                step.num_tokens,
                self.mixed_graphs.eager_reason(step),
            )
        return graph

    def _decode_splits(self, num_decodes: int) -> int:
        """The key ranges each decode row's keys are split into, in a step of
        ``num_decodes`` decode rows (``kernels.paged_decode.launch_grid``: none past the
        SMs' count of (row, KV heads) programs, more the fewer rows)."""
        k_cache, v_cache = self.kv_cache.keys[0], self.kv_cache.values[0]
        return launch_grid(max(1, num_decodes), k_cache, v_cache, self.device)[1]

    def _mixed_graph_seqs(self, rows: int) -> int:
        """The sequences a mixed graph of ``rows`` token rows holds."""
        return min(self.max_num_seqs, rows)

    def _mixed_graph_decode_rows(self, shape: MixedShape) -> int:
        """The sequences a mixed graph's decode kernel covers: all of the graph's, or in a
        split shape only as many as a step that splits its decode keys can have (the packer
        puts decodes first). Every row covered launches the split shape's programs, its
        most splits each, decoding or not: over all of a graph's sequences they took
        several times a light server's whole step."""
        seqs = self._mixed_graph_seqs(shape.rows)
        return split_decode_rows(seqs, self._decode_splits) if shape.split else seqs

    def _step_facts(self, step: Step, slot: SlotBuffers) -> StepFacts:
        """Read what a step's launch needs from the host slot."""
        host = slot.host_inputs
        s = step.num_seqs
        # In every step, not only FULL ones: a request that needs no state may take a row in
        # a GREEDY step and be sampled in a FULL one later, beside another request, with its
        # row's bias (which must then be its own: none).
        num_restarts = int(np.count_nonzero(host.resets_row[:s]))
        full = step.sampling is SamplingMode.FULL
        if not full and not step.prompt_logprobs:
            return StepFacts(num_restarts)
        query_start = host.query_start[: s + 1]
        truncation, num_rows = False, 0
        if full:
            top_k = host.top_k[:s]
            truncation = bool(((top_k > 0) & (top_k < self.vocab)).any())
            truncation = truncation or bool((host.top_p[:s] < 1.0).any())
        if step.prompt_logprobs:
            lengths = np.diff(query_start)
            num_rows = int(np.where(host.has_prompt_logprobs[:s], lengths, 1).sum())
        return StepFacts(num_restarts, truncation, num_rows)

    def _prepare_state(self, step: Step, slot: SlotBuffers, num_restarts: int) -> None:
        """Before any step: clear the rows of the sequences that took them in this step, then
        apply the step's structured-output masks and logit-bias entries (a FULL step's: only
        requests that sample FULL have any; ``sampling_state``). Eager and sized by host
        integers, also before a graph replay: a step with restarts is rare (sequences start in
        prefill steps, mostly), one with masks holds a request that asked for them."""
        inputs, s = slot.inputs, step.num_seqs
        if num_restarts:
            restarts = inputs.resets_row[:s].to(torch.int8)
            order = torch.sort(restarts, descending=True, stable=True).indices[:num_restarts]
            self.state.reset(inputs.request_row[:s][order].long())
        if step.num_token_masks:
            n, extras = step.num_token_masks, slot.extras
            words = self.layout.limits.mask_words
            rows = inputs.request_row[:s][extras.mask_seqs[:n].long()]
            self.state.apply_masks(rows, extras.token_masks[: n * words].view(n, words))
        if step.num_bias_entries:
            n, extras = step.num_bias_entries, slot.extras
            self.state.apply_bias(
                extras.bias_rows[:n], extras.bias_token_ids[:n], extras.bias_values[:n]
            )

    @torch.inference_mode()
    def _compute(self, step: Step, slot: SlotBuffers, facts: StepFacts | None = None) -> None:
        """Any step, eagerly; shapes follow the step's sizes."""
        with products_on(self._eager_blas):
            self._compute_eagerly(step, slot, facts or StepFacts())

    def _compute_eagerly(self, step: Step, slot: SlotBuffers, facts: StepFacts) -> None:
        t, s = step.num_tokens, step.num_seqs
        inputs = slot.inputs
        input_ids = self._carry_over(inputs, t, valid=None)
        positions = inputs.positions[:t]
        query_start = inputs.query_start[: s + 1]
        width = step.block_table_width
        paged = PagedStep.build(
            self.kv_cache,
            slot_mapping=inputs.slot_mapping[:t],
            positions=positions,
            query_start=query_start,
            context_lens=inputs.context_lens[:s],
            block_tables=inputs.block_tables[: s * width].view(s, width),
            block_table_width=inputs.header[_WIDTH : _WIDTH + 1],
            num_single_token_seqs=step.num_single_token_seqs,
            max_query_len=step.max_query_len,
            max_context_len=step.max_context_len,
            kv_group_size=self.attention.kv_group_size,
            windows=self.attention.windows,
            decode_kernel=self.decode_kernel,
            prefill_kernel=self.prefill_kernel,
        )
        full = step.sampling is SamplingMode.FULL
        seq_of_row = rows = None
        if full or step.prompt_logprobs:
            seq_of_row = self._seq_of_row(slot, t, s)
        if full:
            assert seq_of_row is not None
            rows = self._count_step_inputs(step, slot, input_ids, seq_of_row)
        logits = self._eager_logits(step, slot, facts, input_ids, paged, seq_of_row)
        if rows is not None:
            self.sampling.sample_full(slot, logits, s, rows, facts.truncation, step.top_logprobs)
        else:
            self.sampling.sample(slot, logits, s, step.sampling is SamplingMode.GREEDY)

    @torch.inference_mode()
    def _sample_handed_off_logits(self, step: Step, slot: SlotBuffers, facts: StepFacts) -> None:
        """A FULL mixed step after its graph's forward: the full sampler, eagerly as in an
        eager step, on the logits the graph handed over (``LOGITS_HANDOFF``)."""
        t, s = step.num_tokens, step.num_seqs
        assert self._mixed_logits is not None
        input_ids = self._carry_over(slot.inputs, t, valid=None)
        rows = self._count_step_inputs(step, slot, input_ids, self._seq_of_row(slot, t, s))
        logits = self._mixed_logits[:s]
        self.sampling.sample_full(slot, logits, s, rows, facts.truncation, step.top_logprobs)

    def _seq_of_row(self, slot: SlotBuffers, num_tokens: int, num_seqs: int) -> torch.Tensor:
        """Each of a step's rows' sequence ``[num_tokens]``."""
        query_start = slot.inputs.query_start[: num_seqs + 1]
        lengths = query_start[1:] - query_start[:-1]
        return torch.repeat_interleave(self._row_ids[:num_seqs], lengths, output_size=num_tokens)

    def _count_step_inputs(
        self,
        step: Step,
        slot: SlotBuffers,
        input_ids: torch.Tensor,  # [num_tokens], after carry-over
        seq_of_row: torch.Tensor,  # [num_tokens]
    ) -> torch.Tensor:
        """A FULL step's state before sampling (its resets and bias entries done): the rows'
        tokens. Returns each sequence's state row."""
        inputs, t, s = slot.inputs, step.num_tokens, step.num_seqs
        rows = inputs.request_row[:s].long()
        num_prompt = inputs.num_prompt_tokens[:s][seq_of_row]
        self.state.count_inputs(rows[seq_of_row], input_ids, inputs.positions[:t], num_prompt)
        return rows

    def _eager_logits(
        self,
        step: Step,
        slot: SlotBuffers,
        facts: StepFacts,
        input_ids: torch.Tensor,
        paged: PagedStep,
        seq_of_row: torch.Tensor | None,
    ) -> torch.Tensor:
        """The forward; logits ``[num_seqs, vocab]`` of each sequence's last row. Only those
        rows get logits (a decode-only step needs them all), and with prompt
        log-probabilities every row of the sequences that ask for them, whose log-probabilities
        are written here."""
        inputs, t, s = slot.inputs, step.num_tokens, step.num_seqs
        positions = inputs.positions[:t]
        if not step.prompt_logprobs:
            logits_rows = 0 if step.is_decode_only else inputs.query_start[1 : s + 1].long() - 1
            return self._forward(input_ids, positions, paged, logits_rows)
        assert seq_of_row is not None
        kept, last = self._prompt_logits_rows(inputs, seq_of_row, s, facts.num_logits_rows)
        logits = self._forward(input_ids, positions, paged, kept)
        self._write_prompt_logprobs(slot, logits, kept)
        return logits[last]

    def _prompt_logits_rows(
        self,
        inputs: StepInputs[torch.Tensor],
        seq_of_row: torch.Tensor,  # [num_tokens]
        num_seqs: int,
        num_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows that need logits, ascending (every row of the sequences with prompt
        log-probabilities, the last row of the others; ``num_rows`` of them, counted on the
        host), and where each sequence's last row is among them."""
        last_rows = inputs.query_start[1 : num_seqs + 1].long() - 1
        keep = inputs.has_prompt_logprobs[:num_seqs][seq_of_row]
        keep = keep.index_fill(0, last_rows, True)  # [num_tokens]
        # A stable sort puts the kept rows first, in their order: no host synchronisation.
        kept = torch.sort((~keep).to(torch.int8), stable=True).indices[:num_rows]
        last = keep.cumsum(0)[last_rows] - 1
        return kept, last

    def _write_prompt_logprobs(
        self, slot: SlotBuffers, logits: torch.Tensor, kept: torch.Tensor
    ) -> None:
        """Log-probabilities of each kept row's prompt target, and its top alternatives, at
        the row's index in the output fields (rows that are not prompt rows are written too,
        and not read)."""
        targets = slot.extras.prompt_targets[kept].clamp(0, self.vocab - 1)
        logprobs, top_ids, top_logprobs = prompt_logprobs(logits, targets)
        out, k = slot.outputs, MAX_TOP_LOGPROBS
        out.prompt_logprobs.index_copy_(0, kept, logprobs)
        out.prompt_top_ids.view(-1, k).index_copy_(0, kept, top_ids)
        out.prompt_top_logprobs.view(-1, k).index_copy_(0, kept, top_logprobs)

    @torch.inference_mode()
    def _graph_forward(self, slot: DeviceSlot, batch: int) -> ForwardOutputs:
        """A decode graph's forward half: a decode-only step padded to ``batch`` rows, with no
        host value that varies, up to its logits ``[batch, vocab]``, which rows are real
        (``[batch]`` bool) and the rows' input ids after carry-over.

        How many rows are real and how wide the block tables are come from the slot header's
        device copy; padding rows store no keys and attend nothing, and their samples land
        past the ``num_seqs`` rows anyone reads.
        """
        inputs = slot.inputs
        valid = real_rows(slot, self._row_ids, batch)
        input_ids = self._carry_over(inputs, batch, valid)
        # A padding row's context length 0 keeps it from storing or attending anything.
        context_lens = torch.where(valid, inputs.context_lens[:batch], 0)
        paged = DecodeGraphStep(
            self.kv_cache,
            inputs.slot_mapping[:batch],
            context_lens,
            inputs.block_tables,
            inputs.header[_WIDTH : _WIDTH + 1],
        )
        positions = inputs.positions[:batch]
        logits = self._forward(input_ids, positions, paged, logits_rows=0)
        return logits, valid, input_ids

    @torch.inference_mode()  # as the compile-ahead processes trace the samplers
    def _graph_sample(
        self, slot: DeviceSlot, batch: int, variant: GraphVariant, outputs: ForwardOutputs
    ) -> None:
        """A decode graph's sampling half, from its forward half's outputs. A FULL step's
        resets and bias entries ran before the replay (``_prepare_state``)."""
        logits, valid, input_ids = outputs
        self.sampling.sample_decode_rows(slot, logits, batch, variant, valid, input_ids)

    @torch.inference_mode()
    def _mixed_graph_forward(self, slot: DeviceSlot, shape: MixedShape) -> ForwardOutputs:
        """A mixed graph's forward half: a step of decodes and prefill chunks padded to
        ``shape.rows`` token rows, up to the logits of each sequence's last row
        ``[seqs, vocab]``, which sequences are real (``[seqs]`` bool) and their last rows'
        input ids. A split shape splits its decode rows' keys as a step of one decode row
        would (the most splits, whose programs past a short context exit at once), over only
        as many rows as a split step's decodes can take (``_mixed_graph_decode_rows``).

        Everything that varies (how many rows and sequences are real, which are decodes,
        where the chunks start, the block tables' width) comes from the slot's device copy
        (``PagedStep.for_graph``); padding rows store no keys and read position 0, and the
        padding sequences' logits are their first row's, sampled past the ``num_seqs`` rows
        anyone reads.
        """
        inputs, limits, rows = slot.inputs, self.layout.limits, shape.rows
        seqs = self._mixed_graph_seqs(rows)
        num_tokens, num_seqs = inputs.header[_NUM_TOKENS], inputs.header[_NUM_SEQS]
        real_row = self._indices[:rows] < num_tokens
        input_ids = self._carry_over(inputs, rows, real_row)
        positions = torch.where(real_row, inputs.positions[:rows], 0)
        assert self.decode_kernel is not None and self.prefill_kernel is not None
        paged = PagedStep.for_graph(
            self.kv_cache,
            rows=rows,
            seqs=seqs,
            max_chunks=MAX_GRAPH_CHUNKS,
            max_blocks_per_seq=limits.max_blocks_per_seq,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            slot_mapping=inputs.slot_mapping[:rows],
            query_start=inputs.query_start[: seqs + 1],
            context_lens=inputs.context_lens[:seqs],
            block_tables=inputs.block_tables,
            block_table_width=inputs.header[_WIDTH : _WIDTH + 1],
            indices=self._indices,
            decode_kernel=self.decode_kernel,
            prefill_kernel=self.prefill_kernel,
            decode_rows=self._mixed_graph_decode_rows(shape),
            decode_splits=self._decode_splits(1) if shape.split else 1,
        )
        valid = real_rows(slot, self._row_ids, seqs)
        last_rows = torch.where(valid, inputs.query_start[1 : seqs + 1].long() - 1, 0)
        logits = self._forward(input_ids, positions, paged, last_rows)
        return logits, valid, input_ids[last_rows]

    @torch.inference_mode()
    def _mixed_graph_sample(
        self, slot: DeviceSlot, shape: MixedShape, variant: GraphVariant, outputs: ForwardOutputs
    ) -> None:
        """A mixed graph's sampling half; for a FULL step, the logits' hand-off."""
        seqs = self._mixed_graph_seqs(shape.rows)
        if variant != LOGITS_HANDOFF:
            self._graph_sample(slot, seqs, variant, outputs)
            return
        logits = outputs[0]
        if self._mixed_logits is None:  # in the first, uncaptured run: outside the pool
            most = self._mixed_graph_seqs(self._mixed_graph_tokens)
            self._mixed_logits = logits.new_empty((most, logits.shape[1]))
        self._mixed_logits[:seqs].copy_(logits)

    def _carry_over(
        self, inputs: StepInputs[torch.Tensor], num_rows: int, valid: torch.Tensor | None
    ) -> torch.Tensor:
        """Input ids with the carried rows' tokens taken from the last step's samples."""
        carry = inputs.carry_mask[:num_rows]
        if valid is not None:
            carry = carry & valid
        carried = self.last_sampled[inputs.carry_src[:num_rows].long()]
        return torch.where(carry, carried, inputs.input_ids[:num_rows])

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        paged: PagedStep | DecodeGraphStep,
        logits_rows: torch.Tensor | int,
    ) -> torch.Tensor:
        """The model's forward over the step's rows, through the compiled layers where there
        are some and the step has two rows or more: dynamo makes sizes 0 and 1 constants, so
        a row count of 1 would compile the layers again, for one row alone."""
        binding = self.attention.binding
        model: torch.nn.Module = self.model
        step: StepAttention = paged
        settings: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self._compiled_model is not None and input_ids.shape[0] > 1:
            model, step = self._compiled_model, OpaqueStep(paged, binding.number)
            settings = decode_compile_settings()  # as they compiled, should a guard fail
        # The step reaches every layer's attention through the binding, whatever the model's
        # layers pass on (attention/binding.py); it is unbound when the forward returns.
        with settings, binding.bind(step):
            return model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                logits_to_keep=logits_rows,
                use_cache=False,
            ).logits[0]

    # --- stream helpers that do nothing on the CPU ----------------------------------------

    def _on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _record(self, event: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = event if event is not None else torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event
