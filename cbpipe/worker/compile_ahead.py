"""The decode graphs' samplers compiled ahead, in processes of their own, while the worker loads.

With a cold compile cache, compiling the samplers of the decode graphs (plain temperature and
the full sampler's four variants) took 30-35 s of an 8B model's start-up on an H200: in the
worker, one after another, after its forward, and mostly single-threaded Python (dynamo,
AOT, inductor's lowering). Nothing in them needs the model. Their inputs are logits of the
model's width, the full sampler's state and a device slot. So the worker forks a few
processes first thing (before it has a CUDA context, which a forked child could not use),
and once its KV cache is allocated (their device memory must not shrink it) sends each a
share of the variants and the shapes. Each runs ``StepSampling.sample_decode_rows`` on a
device slot of the same layout at the worker's first batch, which writes inductor's and
Triton's on-disk caches and saves each sampler's whole trace (``saved_traces.py``). The
worker's own first run of each variant, after its forward has compiled, then loads what they
wrote instead of compiling it.

On a warm cache with every trace saved the worker stops them at once: they would load what it
loads itself. A process that fails or is late costs nothing but its work: the worker compiles
what it finds missing, as it would without them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from cbpipe.lifetime import end_with_parent, fork_is_safe
from cbpipe.logs import setup_logging
from cbpipe.protocol.slots import REGIONS, SlotLayout, SlotLimits
from cbpipe.worker.compiling import decode_compile_settings
from cbpipe.worker.cuda_graphs import FULL_VARIANTS, GREEDY, RANDOM, GraphVariant
from cbpipe.worker.sampling_state import SamplingState
from cbpipe.worker.saved_traces import SavedTraces
from cbpipe.worker.step_sampling import SAVED_SAMPLERS, StepSampling, device_slot, real_rows

log = logging.getLogger("cbpipe.worker")

# Each process runs its own inductor compile pool: a share of the host's cores, beside the
# worker's own pool, rather than each taking all of them.
_MAX_COMPILE_THREADS = 4
# Device memory a process may take besides its tensors: its CUDA context and workspaces.
_PROCESS_OVERHEAD_BYTES = 1 << 30


@dataclass(frozen=True)
class CompileJob:
    """What a compile-ahead process compiles, and the shapes it compiles for."""

    variants: tuple[GraphVariant, ...]
    limits: SlotLimits  # and the number of slots: the layout (it does not pickle)
    num_slots: int
    max_seqs: int  # the sampler's rows: the most sequences the worker's steps hold
    vocab: int
    logits_dtype: str  # the model's output dtype, as torch names it (bfloat16)
    device: str
    first_batch: int
    cache_env: dict[str, str]  # the worker's compile-cache variables
    log_level: str
    traces_folder: str | None = None  # where the samplers' traces are saved (``SavedTraces``)
    compile_threads: int = 1  # inductor's compile pool in each process

    @property
    def layout(self) -> SlotLayout:
        return SlotLayout.build(self.limits, self.num_slots)

    def device_bytes(self, processes: int) -> int:
        """Device memory ``processes`` running this job take at most, about."""
        dtype = getattr(torch, self.logits_dtype)
        logits = self.first_batch * self.vocab * dtype.itemsize
        layout = self.layout
        slot = sum(end - start for start, end in map(layout.region, REGIONS))
        state = SamplingState.nbytes(self.max_seqs, self.vocab)
        return processes * (state + logits + slot + _PROCESS_OVERHEAD_BYTES)

    def processes_with_room(self, free_bytes: int, most: int) -> int:
        """How many processes, up to ``most``, fit in ``free_bytes`` of device memory with as
        much again to spare."""
        return min(most, free_bytes // (2 * self.device_bytes(1)))


def ahead_variants(full_sampling: bool) -> tuple[GraphVariant, ...]:
    """The variants whose samplers compile ahead: all but the full sampler's variants with
    alternatives, which take them after the compiled sampler of their twin without
    (``StepSampling.sample_full``). Greedy's sampler is one op, whose compile is part of the
    forward's in the worker; it is here to have its trace saved."""
    full = [v for v in FULL_VARIANTS if not v.top_logprobs] if full_sampling else []
    return (RANDOM, *full, GREEDY)


def shares(variants: tuple[GraphVariant, ...], count: int) -> list[tuple[GraphVariant, ...]]:
    """``variants`` dealt out over ``count`` processes, in turn (none left empty)."""
    dealt = [variants[i::count] for i in range(min(count, len(variants)))]
    return [share for share in dealt if share]


class CompileAhead:
    """Forked processes, each waiting for its job (or for none) on a pipe."""

    def __init__(self, processes: list[tuple[mp.process.BaseProcess, mp.connection.Connection]]):
        self._processes = processes
        self._started_at: float | None = None
        self._working = 0  # how many of them were given variants

    @classmethod
    def fork(cls, count: int) -> CompileAhead | None:
        """``count`` waiting processes, or None where forking is not safe
        (``lifetime.fork_is_safe``)."""
        if not fork_is_safe():
            return None
        context = mp.get_context("fork")
        processes = []
        for index in range(count):
            receiver, sender = context.Pipe(duplex=False)
            # Daemonic: an interpreter that exits before it sent the jobs ends them too.
            process = context.Process(
                target=_main,
                args=(receiver, sender, os.getpid()),
                name=f"compile_ahead_{index}",
                daemon=True,
            )
            process.start()
            receiver.close()
            processes.append((process, sender))
        return cls(processes)

    def __len__(self) -> int:
        return len(self._processes)

    def start(self, job: CompileJob, processes: int | None = None) -> None:
        """Send each of the first ``processes`` (all by default) its share of ``job``'s
        variants, with a share of the host's cores; the rest get nothing to do."""
        self._started_at = time.perf_counter()
        count = len(self._processes) if processes is None else min(processes, len(self._processes))
        dealt = shares(job.variants, count)
        threads = max(1, min(_MAX_COMPILE_THREADS, (os.cpu_count() or 1) // (len(dealt) + 1)))
        jobs = [
            dataclasses.replace(job, variants=share, compile_threads=threads) for share in dealt
        ]
        self._working = len(jobs)
        for index, (_, conn) in enumerate(self._processes):
            with contextlib.suppress(OSError):  # it died already
                conn.send(jobs[index] if index < len(jobs) else None)
            conn.close()

    def stop(self) -> None:
        """Tell every process there is nothing to do, and reap them."""
        for _, conn in self._processes:
            if not conn.closed:
                with contextlib.suppress(OSError):  # it died already
                    conn.send(None)
                conn.close()
        for process, _ in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        self._processes = []

    def wait(self, timeout_s: float = 300.0) -> None:
        """Until every process has finished, at most ``timeout_s``; a late one is killed (the
        worker compiles what it did not)."""
        if self._started_at is None:
            self.stop()
            return
        waited = time.perf_counter()
        deadline = waited + timeout_s
        codes = []
        for process, _ in self._processes:
            process.join(timeout=max(0.0, deadline - time.perf_counter()))
            if process.is_alive():
                log.warning("%s still compiling after %.0f s: stopped", process.name, timeout_s)
                process.kill()
                process.join()
            codes.append(process.exitcode)
        now = time.perf_counter()
        log.info(
            "samplers compiled ahead: %d of %d processes given variants, done (exit codes %s) "
            "%.1f s after their start, waited for %.1f s",
            self._working,
            len(self._processes),
            codes,
            now - self._started_at,
            now - waited,
        )
        self._processes = []


def _main(
    conn: mp.connection.Connection, worker_end: mp.connection.Connection, worker_pid: int
) -> None:
    worker_end.close()  # the fork's copy: with it open, a worker gone would never read as EOF
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    end_with_parent(worker_pid)
    code = 0
    try:
        job = conn.recv()
        if job is not None:
            compile_variants(job)
    except EOFError:
        pass  # the worker ended before it sent a job
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)  # skip the interpreter's teardown, as the worker's children do


def compile_variants(job: CompileJob) -> None:
    """Compile ``job``'s variants as the worker's decode graphs first run them."""
    from torch._inductor import config as inductor_config

    setup_logging(job.log_level, "compile_ahead")
    os.environ.update(job.cache_env)
    inductor_config.compile_threads = job.compile_threads  # not part of any artifact's key
    device = torch.device(job.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    layout, batch, max_seqs = job.layout, job.first_batch, job.max_seqs
    slot = device_slot(layout, device)
    state = SamplingState.allocate(max_seqs, job.vocab, device)
    saved = None if job.traces_folder is None else SavedTraces(Path(job.traces_folder), writes=True)
    sampling = StepSampling(state, max_seqs, device, compiled=True, saved=saved)
    row_ids = torch.arange(max_seqs, device=device)
    for variant in job.variants:
        started = time.perf_counter()
        with decode_compile_settings(), torch.inference_mode():
            # As the worker's forward leaves them: logits a fresh [1, batch, vocab] output's
            # row view, the validity of each row from the slot's header.
            logits = torch.zeros(1, batch, job.vocab, dtype=getattr(torch, job.logits_dtype),
                                 device=device)[0]  # fmt: skip
            valid = real_rows(slot, row_ids, batch)
            input_ids = torch.zeros(batch, dtype=torch.int64, device=device)
            sampling.sample_decode_rows(slot, logits, batch, variant, valid, input_ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        log.debug("compiled %s ahead in %.1f s", variant.label, time.perf_counter() - started)


def needs_compiling(traces_folder: str | None) -> bool:
    """Whether the processes have work: inductor's cache is cold, or a sampler's trace has
    not been saved yet."""
    if cache_is_cold():
        return True
    return traces_folder is not None and bool(
        SavedTraces(Path(traces_folder)).missing(SAVED_SAMPLERS)
    )


def cache_is_cold() -> bool:
    """Whether inductor's cache holds no compiled graph yet (the worker points it at the
    model's folder first: ``compile_cache.use_compile_cache``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    graphs = Path(cache_dir()) / "fxgraph"
    return not graphs.is_dir() or not any(graphs.iterdir())
