"""The worker's start-up line: each phase once, the runner's timed parts in its place, and
what garbage collection took."""

from __future__ import annotations

import gc

import pytest

from cbpipe.worker import process
from cbpipe.worker.process import StartupPhases


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(process.time, "perf_counter", clock)
    return clock


def test_the_runners_parts_replace_its_phase_and_the_total_is_the_elapsed_time(
    clock: _Clock,
) -> None:
    phases = StartupPhases()
    clock.now += 1.5
    phases.done("weights")
    clock.now += 25.0
    phases.done("runner set-up", parts={"warm-up": 12.0, "compile": 10.0, "capture": 2.5})
    assert list(phases.seconds) == [
        "weights",
        "warm-up",
        "compile",
        "capture",
        "runner set-up",
    ]
    assert phases.seconds["runner set-up"] == pytest.approx(0.5)
    line = phases.finish()
    assert line.startswith("26.5 s (weights 1.5 s, warm-up 12.0 s, compile 10.0 s")
    assert "; garbage collection " in line


def test_the_line_counts_the_collections_made_during_start_up() -> None:
    phases = StartupPhases()
    gc.collect()
    line = phases.finish()
    gc.collect()  # after the line: not counted
    assert phases.collections.counts[2] == 1
    assert line.endswith(f"(1 full: {phases.collections.seconds[2]:.2f} s)")


def test_a_remainder_too_small_to_matter_gets_no_phase_of_its_own(clock: _Clock) -> None:
    phases = StartupPhases()
    clock.now += 3.01
    phases.done("runner set-up", parts={"warm-up": 3.0})
    assert list(phases.seconds) == ["warm-up"]


def test_without_parts_the_phase_is_the_whole_time_even_when_short(clock: _Clock) -> None:
    phases = StartupPhases()
    clock.now += 0.01
    phases.done("device")
    assert phases.seconds == {"device": pytest.approx(0.01)}
