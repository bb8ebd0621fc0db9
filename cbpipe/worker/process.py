"""The worker process: load the model, then run every step the scheduler sends, in order.

The main thread receives steps and enqueues their device work; a completion thread waits for
each step's device-to-host copy and reports ``StepDone``. So the next step is enqueued while
the previous one still runs, and the device never waits for the worker's Python.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection

import torch
import zmq

from cbpipe.collector import CollectionClock, CollectorPacing
from cbpipe.config import SchedulerConfig
from cbpipe.lifetime import process_age_s
from cbpipe.logs import setup_logging
from cbpipe.models import resolve_model
from cbpipe.models.support import UnsupportedModel
from cbpipe.protocol.launch import RunSpec
from cbpipe.protocol.messages import (
    Message,
    Shutdown,
    Step,
    StepDone,
    WorkerFailed,
    WorkerReady,
    decode,
    encode,
)
from cbpipe.protocol.security import seal
from cbpipe.protocol.shm import AttachedSegment
from cbpipe.protocol.slots import SlotLimits
from cbpipe.worker import attention
from cbpipe.worker.blas import BlasLibraries, use_blas_library
from cbpipe.worker.compile_ahead import CompileAhead, CompileJob, ahead_variants, needs_compiling
from cbpipe.worker.compile_cache import CACHE_VARIABLES, use_compile_cache
from cbpipe.worker.cuda_graphs import (
    bucket_sizes,
    capture_blocker,
    compiled_bucket_sizes,
    tuning_batch,
)
from cbpipe.worker.model_loader import (
    allocate_kv_cache,
    num_kv_blocks,
    resolve_device,
    resolve_dtype,
    start_paged_model,
)
from cbpipe.worker.runner import LaunchedStep, StepRunner, logits_width
from cbpipe.worker.sampling_state import SamplingState
from cbpipe.worker.saved_traces import SavedTraces, traces_are_supported
from cbpipe.worker.step_profiler import StepProfiler
from cbpipe.worker.tensor_parallel import TensorParallel

log = logging.getLogger("cbpipe.worker")

_STOP = object()
IDLE_MS = 100  # no step for this long: the worker is idle
# One a compiled sampler: most of a process's time is fixed (its CUDA context, dynamo's and
# inductor's start), so fewer processes, each compiling several variants in turn, finished
# after the worker and held up its start-up (docs/PERFORMANCE.md). Those that the device has
# no room for are not started.
COMPILE_AHEAD_PROCESSES = len(ahead_variants(full_sampling=True))
HEARTBEAT_PERIOD_S = 0.1
RESULTS_LINGER_MS = 1000  # for the last reports to reach the scheduler as the worker stops


def worker_main(spec: RunSpec, ready: Connection, rank: int = 0) -> None:
    """Entry point of a worker process (started by the launcher): tensor-parallel rank
    ``rank`` of ``--tensor-parallel-size``, the only one without tensor parallelism.

    Every rank receives every step and runs it; rank 0 alone writes the outputs into the
    slot and reports the step done. All ranks report ready, and failures."""
    name = spec.worker_names[rank]
    setup_logging(spec.config.log_level, name)
    ahead = _fork_compile_ahead(spec)  # before this process has threads or a CUDA context
    context = zmq.Context()
    steps = context.socket(zmq.SUB)
    steps.setsockopt(zmq.SUBSCRIBE, b"")  # now, so it has reached the scheduler by our ready
    steps.connect(spec.addresses.worker_steps)
    outbox: queue.Queue = queue.Queue()
    sender = threading.Thread(
        target=_send_completions,
        args=(context, spec.addresses.worker_results, spec.results_token, outbox, rank == 0),
        name="completions",
        daemon=True,
    )
    sender.start()
    runner = segment = None
    try:
        runner, segment, hello = _load(spec, rank, ahead)
        _keep_beating(spec.heartbeats(segment.buf).beater(name))
        outbox.put(hello)
        ready.send(("ready", f"{hello.model} on {hello.device}, {hello.num_blocks} KV blocks"))
        _serve(steps, runner, outbox)
    except UnsupportedModel as exc:  # the reason is the whole story: no traceback
        # The launcher first, so that its message is this one rather than the scheduler's
        # (which fails too, on the WorkerFailed below).
        ready.send(("failed", str(exc)))
        outbox.put(WorkerFailed(str(exc)))
        raise SystemExit(1) from None
    except Exception as exc:
        log.exception("worker failed")
        outbox.put(WorkerFailed(f"{type(exc).__name__}: {exc}"))
        if runner is None:
            ready.send(("failed", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if ahead is not None:
            ahead.stop()  # a start-up that failed before it waited for them
        outbox.put(_STOP)
        sender.join(timeout=10)
        if runner is not None:
            runner.close()
        if segment is not None:
            segment.close()
        steps.close(linger=0)
        context.term()


def _fork_compile_ahead(spec: RunSpec) -> CompileAhead | None:
    """The processes that compile the decode graphs' samplers while this one loads
    (``compile_ahead.py``), where the decode path compiles on CUDA; one rank alone."""
    worker = spec.config.worker
    if not (worker.compile_decode and worker.cuda_graphs) or spec.rendezvous is not None:
        return None
    if spec.config.model.device == "cpu" or not torch.backends.cuda.is_built():
        return None
    return CompileAhead.fork(COMPILE_AHEAD_PROCESSES)


def _start_compile_ahead(
    ahead: CompileAhead, job: CompileJob, device: torch.device, runner_compiles: bool
) -> None:
    """Give ``ahead`` its job where it helps: a cold cache or a sampler's trace not saved yet,
    a compiled decode path, and room on the device for the processes with as much again to
    spare (the KV cache is sized already: what is left is the worker's own working room), as
    many processes as there is room for. Else stop them."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    room = job.processes_with_room(free, len(ahead))
    if runner_compiles and needs_compiling(job.traces_folder) and room:
        ahead.start(job, processes=room)
    else:
        ahead.stop()


def _load(
    spec: RunSpec, rank: int, ahead: CompileAhead | None
) -> tuple[StepRunner, AttachedSegment, WorkerReady]:
    phases = StartupPhases.since_process_start()
    config = spec.config
    rendezvous = spec.rendezvous
    device = resolve_device(config.model.device, None if rendezvous is None else rank)
    dtype = resolve_dtype(config.model.dtype, device)
    if device.type == "cpu":
        # Leave a core to the scheduler: the overlap we exist for is between processes; the
        # ranks share the rest.
        world_size = 1 if rendezvous is None else rendezvous.world_size
        torch.set_num_threads(max(1, ((os.cpu_count() or 2) - 1) // world_size))
    tp = TensorParallel() if rendezvous is None else TensorParallel.join(rendezvous, rank, device)
    source = resolve_model(config.model.model, config.model.revision)
    cuda = device.type == "cuda"
    traces: SavedTraces | None = None
    blas: BlasLibraries | None = None
    if cuda:  # nothing is compiled on the CPU (Triton is interpreted there)
        cache = use_compile_cache(config.worker.compile_cache_dir, source.config, dtype, device)
        if cache is not None and config.worker.saved_traces and traces_are_supported():
            traces = SavedTraces(cache / "traces")
        torch.zeros(1, device=device)  # the context, which the weights would otherwise pay for
        blas = use_blas_library(config.worker.blas_library, device)
        log.info("matrix products on %s", blas)
    phases.done("device")
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else None
    max_num_seqs, max_batch_tokens = step_limits(config.scheduler, memory, spec.layout.limits)
    log.info("%d sequences and %d tokens a step at most", max_num_seqs, max_batch_tokens)
    loading = start_paged_model(
        source,
        device,
        dtype,
        seed=config.model.seed,
        fuse=config.worker.fuse_projections,
        max_model_len=config.model.max_model_len,
        tp=tp,
    )
    model, paged = loading.model, loading.attention
    phases.done("weights")
    # The full sampler's per-request rows come out of the memory the KV cache is sized from.
    vocab = logits_width(model)
    state = SamplingState.allocate(max_num_seqs, vocab, device)
    log.info(
        "sampling state: %d request rows of %d tokens, %.1f MB",
        max_num_seqs,
        vocab,
        SamplingState.nbytes(max_num_seqs, vocab) / 1e6,
    )
    # Every rank holds its kv heads of every block: the ranks agree on the fewest blocks any
    # of them has room for, so the scheduler's block tables mean the same on each.
    num_blocks = tp.min_int(num_kv_blocks(paged, config.cache, device, dtype), device)
    kv_cache = allocate_kv_cache(paged, num_blocks, config.cache.block_size, device, dtype)
    phases.done("KV cache")
    segment = AttachedSegment(spec.segment_name, spec.layout.segment_nbytes)
    decode_kernel = attention.load_decode_kernel(config.worker.attention_backend, device)
    prefill_kernel = attention.load_prefill_kernel(config.worker.prefill_attention_backend, device)
    phases.done("kernels")
    graph_sizes: list[int] = []
    if config.worker.cuda_graphs and cuda and decode_kernel is not None:
        max_graph_batch = config.worker.max_graph_batch or max_num_seqs
        graph_sizes = bucket_sizes(min(max_graph_batch, max_num_seqs))
    compile_decode = config.worker.compile_decode and bool(graph_sizes)
    mixed_graph_tokens = config.worker.mixed_graph_tokens
    if tp.world_size > 1 and mixed_graph_tokens and cuda:
        # Measured on one GPU only (docs/PERFORMANCE.md, session 36): until a run on two
        # checks them against one rank, sharded steps' mixed graphs stay off.
        log.info("mixed-step graphs are off with tensor parallelism: mixed steps run eagerly")
        mixed_graph_tokens = 0
    if ahead is not None:
        job = CompileJob(
            variants=ahead_variants(full_sampling=True),
            limits=spec.layout.limits,
            num_slots=spec.layout.num_slots,
            max_seqs=max_num_seqs,
            vocab=vocab,
            logits_dtype=str(dtype).removeprefix("torch."),
            device=str(device),
            first_batch=tuning_batch(compiled_bucket_sizes(graph_sizes or [1])),
            cache_env={v: os.environ[v] for v in CACHE_VARIABLES.values() if v in os.environ},
            log_level=config.log_level,
            traces_folder=None if traces is None else str(traces.folder),
        )
        runner_compiles = compile_decode and capture_blocker(model) is None
        _start_compile_ahead(ahead, job, device, runner_compiles)
        phases.done("compile-ahead hand-off")
    runner = StepRunner(
        model,
        paged,
        kv_cache,
        spec.layout,
        segment.buf,
        device,
        decode_kernel=decode_kernel,
        prefill_kernel=prefill_kernel,
        graph_batch_sizes=graph_sizes,
        compile_decode=compile_decode,
        sampling_state=state,
        writes_outputs=tp.rank == 0,
        before_sampler_compiles=None if ahead is None else ahead.wait,
        saved_traces=traces,
        max_batch_tokens=max_batch_tokens,
        max_num_seqs=max_num_seqs,
        blas=blas,
        mixed_graph_tokens=mixed_graph_tokens,
    )
    phases.done("runner set-up", parts=runner.startup_seconds)
    loading.wait_for_weights()
    phases.done("weights' wait")
    log.info("start-up: %s", phases.finish())
    hello = WorkerReady(
        model=source.name,
        vocab_size=int(model.config.get_text_config().vocab_size),
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_num_seqs=max_num_seqs,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        eos_token_ids=source.eos_token_ids,
        rank=tp.rank,
        world_size=tp.world_size,
    )
    return runner, segment, hello


def step_limits(
    scheduler: SchedulerConfig, device_memory: int | None, slots: SlotLimits
) -> tuple[int, int]:
    """The most sequences and tokens a step holds: the flags, else the defaults for a device
    of ``device_memory`` bytes, within what the slots hold (the launcher sizes them for a
    small device's defaults where the shared memory has no room for a large one's)."""
    num_seqs = scheduler.num_seqs(device_memory)
    num_tokens = scheduler.batch_tokens(device_memory)
    if num_seqs > slots.max_seqs or num_tokens > slots.max_tokens:
        log.warning(
            "this device takes %d sequences and %d tokens a step by default, but /dev/shm had "
            "room for slots of %d and %d only: give it more (docker run --shm-size=1g, or "
            "--ipc=host) for the larger steps",
            num_seqs,
            num_tokens,
            slots.max_seqs,
            slots.max_tokens,
        )
    return min(num_seqs, slots.max_seqs), min(num_tokens, slots.max_tokens)


class StartupPhases:
    """How long each part of the worker's start-up took, for ``--log-level info``."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.collections = CollectionClock().start()

    @classmethod
    def since_process_start(cls) -> StartupPhases:
        """Phases whose first is the interpreter's start and the imports, up to now."""
        phases = cls()
        age = process_age_s()
        if age is not None:
            phases.seconds["imports"] = age
        return phases

    def done(self, name: str, parts: Mapping[str, float] | None = None) -> None:
        """The time since the last phase, as ``name``; with ``parts``, the parts of it that
        were timed inside, each its own phase, and ``name`` what is left (when that is
        worth a line)."""
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        parts = parts or {}
        self.seconds.update(parts)
        rest = elapsed - sum(parts.values())
        if not parts or rest >= 0.05:
            self.seconds[name] = rest

    def finish(self) -> str:
        """The line: the total, each phase, and what garbage collection took of it."""
        self.collections.stop()
        total = sum(self.seconds.values())
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())
        return f"{total:.1f} s ({parts}); garbage collection {self.collections.describe()}"


def _keep_beating(beat: Callable[[], None]) -> None:
    """Stamp the worker's heartbeat from a thread of its own: the main thread may spend
    minutes in one step on a CPU, and a step the device never finishes is the scheduler's
    deadline to notice; this is for a worker process that stopped or died."""

    def run() -> None:
        while True:
            beat()
            time.sleep(HEARTBEAT_PERIOD_S)

    threading.Thread(target=run, name="heartbeat", daemon=True).start()


def _serve(steps: zmq.Socket, runner: StepRunner, outbox: queue.Queue) -> None:
    if runner.cuda:
        from cbpipe.worker.kernels.jit import warn_of_compiles

        warn_of_compiles()
    profiler = StepProfiler.from_env()
    collector = CollectorPacing()
    collector.start()
    try:
        while True:
            if not steps.poll(IDLE_MS):
                collector.on_idle()  # no step for a while: a full collection costs nothing
                runner.recalibrate_clock()
                continue
            message = decode(steps.recv(), expected=(Step, Shutdown))
            if isinstance(message, Shutdown):
                log.info("shutdown requested")
                return
            assert isinstance(message, Step)
            if profiler is not None:
                profiler.before_launch(message.step)
            outbox.put(runner.launch(message))
            if profiler is not None:
                profiler.after_launch(message.step)
            collector.between_steps()
    finally:
        collector.stop()


def _send_completions(
    context: zmq.Context, address: str, token: bytes, outbox: queue.Queue, reports_steps: bool
) -> None:
    """Owns the results socket: reports each step once its outputs are in shared memory
    (``reports_steps``: rank 0; the other ranks wait for each step too, so that a device
    failure surfaces here, but send only their handshake and failures)."""
    results = context.socket(zmq.PUSH)
    # Set now: once the context is ending, ZeroMQ refuses every option, and close(linger=...)
    # ignores that refusal, so the socket would keep the default (wait for ever).
    results.setsockopt(zmq.LINGER, RESULTS_LINGER_MS)
    results.connect(address)
    try:
        while (item := outbox.get()) is not _STOP:
            message: Message = item.wait() if isinstance(item, LaunchedStep) else item
            if reports_steps or not isinstance(message, StepDone):
                results.send(seal(token, encode(message)))
    except zmq.ContextTerminated:
        # The main thread stopped waiting for this one (a send blocked on a scheduler that is
        # gone, a step still running) and ended the context, whose term() waits for this
        # socket: close it. A second send here raised again and left the socket open, and
        # term() never returned.
        results.close()
        return
    except Exception as exc:
        log.exception("step failed on the device")
        with contextlib.suppress(zmq.ZMQError):  # never blocks: the exit below must come
            failed = WorkerFailed(f"{type(exc).__name__}: {exc}")
            results.send(seal(token, encode(failed)), flags=zmq.NOBLOCK)
        results.close()
        os._exit(1)  # the main thread may be blocked on a receive; the launcher notices
    results.close()
