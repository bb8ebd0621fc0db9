"""When a process lets Python's cyclic garbage collector walk the old generation.

A full collection walks every object the collector tracks, and both engine processes hold
many: the scheduler each request's token lists, job state and the trace's step records; the
worker the model's modules and everything transformers and torch import. In an H200 run of
random:llama-1b with 256 sequences, full collections in the scheduler came every ~130 steps
and took 5-7 ms inside ``schedule+pack``, growing with the run, against 1 ms of slack between
a 3.4 ms step and 2.4 ms of scheduling; each left the GPU idle. In the 1b x1024 run, gaps of
2-5 ms came every ~133 steps before steps whose scheduling was on time: the worker's turn,
most likely (``docs/PERFORMANCE.md``).

Young collections stay automatic: they walk only objects made since the last one, and take
tens of microseconds. The scheduler sizes its young generation to hold what a few steps in
flight make (``young_threshold``), so that the objects a step makes and frees are not walked
on the way: at the interpreter's 700 a step of 1,024 sequences was collected six times.

The old generation is collected when the process has nothing to do, and under unbroken load
at most once every ``max_interval_s``, right after a step is sent or launched (the device
then has a step of work queued). Objects freed by reference counting,
which is nearly all of them, never wait for the collector either way.

CUDA graph captures run with the collector paused (``collector_paused``), as vLLM's and
SGLang's do: a collection during a capture can run a finalizer (a compiled module unloading
its kernels) that invalidates it. On the H200 the captures made no full collection either way,
so the pause saves no time (docs/PERFORMANCE.md). ``CollectionClock`` says what the collector
took, for the worker's start-up line.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

# gen1 collections between full ones: far more than a run makes between idle moments.
_NEVER = 1 << 30


class CollectorPacing:
    def __init__(self, max_interval_s: float = 60.0) -> None:
        self.max_interval_s = max_interval_s
        self._last_full = time.monotonic()
        self._saved_threshold: tuple[int, int, int] | None = None

    def start(self, young_threshold: int = 0) -> None:
        """Freeze what start-up made and stop automatic full collections; with
        ``young_threshold``, let the young generation grow to that many objects (never fewer
        than the interpreter's setting) before it is collected."""
        # Start-up's objects (modules, the model, a tokenizer) live as long as the process.
        gc.freeze()
        young, middle, _ = self._saved_threshold = gc.get_threshold()
        gc.set_threshold(max(young, young_threshold), middle, _NEVER)
        self._last_full = time.monotonic()

    def stop(self) -> None:
        if self._saved_threshold is not None:
            gc.set_threshold(*self._saved_threshold)
            self._saved_threshold = None

    def on_idle(self) -> None:
        """Nothing to do: collect the old generation if anything reached it since the last."""
        if gc.get_count()[2] > 0:
            self._collect("idle")

    def between_steps(self) -> None:
        """Under load: a full collection once ``max_interval_s`` has passed since the last."""
        if time.monotonic() - self._last_full >= self.max_interval_s:
            self._collect("overdue")

    def _collect(self, why: str) -> None:
        start = time.perf_counter()
        found = gc.collect()
        self._last_full = time.monotonic()
        log.debug(
            "full garbage collection (%s): %d unreachable, %.2f ms",
            why,
            found,
            (time.perf_counter() - start) * 1e3,
        )


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside. Nothing is frozen: a cycle of garbage that holds
    device memory must stay collectable."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CollectionClock:
    """The collections, and their seconds, by generation, while installed."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started: float | None = None

    def start(self) -> CollectionClock:
        gc.callbacks.append(self._on_collection)
        return self

    def stop(self) -> None:
        with contextlib.suppress(ValueError):  # stopped already
            gc.callbacks.remove(self._on_collection)

    def __enter__(self) -> CollectionClock:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            generation = info["generation"]
            self.counts[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started
            self._started = None

    def describe(self) -> str:
        return (
            f"{sum(self.seconds):.2f} s in {sum(self.counts)} collections "
            f"({self.counts[2]} full: {self.seconds[2]:.2f} s)"
        )
