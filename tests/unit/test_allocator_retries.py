"""The worker's count of the caching allocator's retries (a stall inside a step's launch)."""

from __future__ import annotations

from cbpipe.worker.runner import AllocatorRetries


def test_retries_count_from_the_runner_being_ready() -> None:
    stats = {"num_alloc_retries": 3}  # the warm-up's and the capture's, not serving's
    retries = AllocatorRetries(lambda: stats)
    assert retries.check() == 0 and retries.since_ready == 0
    stats["num_alloc_retries"] = 5
    assert retries.check() == 2
    assert retries.check() == 0
    stats["num_alloc_retries"] = 6
    assert retries.check() == 1 and retries.since_ready == 3


def test_an_allocator_without_the_statistic_counts_none() -> None:
    retries = AllocatorRetries(dict)
    assert retries.check() == 0 and retries.since_ready == 0
