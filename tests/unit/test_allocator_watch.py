"""The worker's watch on the caching allocator: its retries (a stall inside a step's launch)
and the memory it asks CUDA for, counted from the runner being ready."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from cbpipe.worker import runner as runner_module
from cbpipe.worker.runner import AllocatorDelta, AllocatorWatch, StepRunner


def test_retries_and_allocations_count_from_the_runner_being_ready() -> None:
    # The warm-up's and the capture's, not serving's.
    stats = {"num_alloc_retries": 3, "num_device_alloc": 40}
    watch = AllocatorWatch(lambda: stats)
    assert watch.check() == AllocatorDelta(0, 0) and watch.since_ready == 0
    stats.update(num_alloc_retries=5, num_device_alloc=43)
    assert watch.check() == AllocatorDelta(retries=2, device_allocations=3)
    assert watch.check() == AllocatorDelta(0, 0)
    stats["num_alloc_retries"] = 6
    assert watch.check() == AllocatorDelta(1, 0) and watch.since_ready == 3


def test_an_allocator_without_the_statistics_counts_none() -> None:
    watch = AllocatorWatch(dict)
    assert watch.check() == AllocatorDelta(0, 0) and watch.since_ready == 0


def test_an_eager_launch_s_debug_line_names_what_may_have_held_it_up(caplog, monkeypatch) -> None:
    stats = {"num_alloc_retries": 0, "num_device_alloc": 7}
    runner = SimpleNamespace(_allocator=AllocatorWatch(lambda: stats), _collections_seen=20)
    step = SimpleNamespace(step=12, num_tokens=8192)
    stats.update(num_device_alloc=9, num_alloc_retries=1)
    monkeypatch.setattr(runner_module, "collections_so_far", lambda: 24)
    with caplog.at_level(logging.DEBUG, logger="cbpipe.worker.runner"):
        StepRunner._log_launch(runner, step, 42.0, eager=True)  # type: ignore[arg-type]
        StepRunner._log_launch(runner, step, 1.0, eager=False)  # type: ignore[arg-type]
    (line,) = [r.getMessage() for r in caplog.records]  # the replay met nothing: no line
    assert line == (
        "step 12 (8192 rows, eager): launched in 42.0 ms; the caching allocator asked CUDA "
        "for memory 2 times and freed its cache and retried 1 times; 4 garbage collections "
        "since the previous launch"
    )
