"""The worker's watch on the caching allocator: its retries (a stall inside a step's launch)
and the memory it asks CUDA for, counted from the runner being ready."""

from __future__ import annotations

from cbpipe.worker.runner import AllocatorDelta, AllocatorWatch


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
