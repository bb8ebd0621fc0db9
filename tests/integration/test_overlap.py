"""Asynchrony hides the scheduler's CPU time: measured as a ratio of wall times, not a speed.

The sync run is first timed without extra delay to learn the time of one step on this
machine; both modes then run with ``--debug-scheduler-delay-ms`` set to that time. Sync pays
delay + compute per step; async overlaps them, so it should take clearly less.
"""

from __future__ import annotations

import time

import pytest

from cbpipe.client import Client
from cbpipe.engine_process import EngineProcess

NUM_REQUESTS = 8
NEW_TOKENS = 120
ENGINE = ["--model", "random:qwen2-tiny", "--device", "cpu", "--num-blocks", "256"]


def timed_run(flags: list[str]) -> float:
    """Wall time of one batch of fixed-length jobs, after a warm-up job."""
    with EngineProcess.start([*ENGINE, *flags]) as engine, Client(engine.address) as client:
        client.generate([[5, 6, 7]], max_new_tokens=8, ignore_eos=True, timeout=60)
        prompts = [[10 + i] * (4 + i) for i in range(NUM_REQUESTS)]
        start = time.perf_counter()
        results = client.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                  timeout=300)  # fmt: skip
        elapsed = time.perf_counter() - start
    assert all(len(r.token_ids) == NEW_TOKENS for r in results)
    return elapsed


@pytest.mark.slow
def test_async_hides_scheduler_delay_that_sync_pays() -> None:
    step_ms = timed_run(["--sync"]) / NEW_TOKENS * 1e3
    delay = ["--debug-scheduler-delay-ms", f"{step_ms:.2f}"]
    # Ideal: async ~ half of sync. The overlap needs the scheduler and the worker on a core
    # each; other work on a shared 2-core machine takes one away for a while, and then the
    # two modes tie. Such load can only hide the overlap, never fake it: the best of three
    # pairs of runs is the machine's answer.
    seen = []
    for _ in range(3):
        sync = timed_run(["--sync", *delay])
        async_ = timed_run(delay)
        seen.append(f"async {async_:.2f} s vs sync {sync:.2f} s")
        if async_ < 0.8 * sync:
            return
    pytest.fail(f"no overlap in three tries (step {step_ms:.1f} ms): {'; '.join(seen)}")
