"""The engine processes' garbage-collection pacing: no automatic full collections, full ones
when idle or overdue, and the interpreter's settings given back; no collection at all while
CUDA graphs are captured; the collections a start-up made, counted."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from cbpipe.collector import CollectionClock, CollectorPacing, collector_paused


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def pacing() -> Iterator[CollectorPacing]:
    before = gc.get_threshold()
    pacing = CollectorPacing(max_interval_s=3600)
    pacing.start()
    yield pacing
    pacing.stop()
    gc.unfreeze()
    assert gc.get_threshold() == before


def _full_collections_during(work) -> int:
    generations: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(record)
    try:
        work()
    finally:
        gc.callbacks.remove(record)
    return generations.count(2)


def _churn() -> None:
    keep = []
    for i in range(300_000):  # thousands of young collections' worth of containers
        keep.append([i])
        if len(keep) > 5000:
            keep.clear()


def test_no_automatic_full_collection_while_paced(pacing: CollectorPacing) -> None:
    assert _full_collections_during(_churn) == 0


def test_python_would_have_collected_fully_without_it() -> None:
    # The control: the same churn under the interpreter's own settings does reach generation 2,
    # so the test above can fail. CPython skips a full collection until the objects promoted
    # since the last one exceed a quarter of the long-lived ones, so in a whole test run (a
    # heap of torch and transformers) the churn alone never got there: freeze that heap and
    # collect, and the count of long-lived objects starts near zero.
    gc.freeze()
    try:
        gc.collect()
        assert _full_collections_during(_churn) > 0
    finally:
        gc.unfreeze()


def _step_like_churn() -> None:
    """Steps' worth of objects: each made, held while its step is in flight, then freed."""
    for _ in range(50):
        step = [(i, None) for i in range(3000)]
        del step


def test_a_young_threshold_lets_objects_that_die_young_go_unwalked() -> None:
    before = gc.get_threshold()
    gc.freeze()
    pacing = CollectorPacing(max_interval_s=3600)
    try:
        pacing.start(young_threshold=10_000)
        assert gc.get_threshold()[0] == 10_000
        with CollectionClock() as clock:
            _step_like_churn()
        assert clock.counts[0] == 0
        pacing.stop()
        assert gc.get_threshold() == before
        pacing.start()  # the control: the interpreter's own young generation
        with CollectionClock() as clock:
            _step_like_churn()
        assert clock.counts[0] >= 10  # about once a step here
    finally:
        pacing.stop()
        gc.unfreeze()
    assert gc.get_threshold() == before


def test_a_young_threshold_never_lowers_the_interpreter_s(pacing: CollectorPacing) -> None:
    pacing.stop()
    young = gc.get_threshold()[0]
    pacing.start(young_threshold=young // 2)
    assert gc.get_threshold()[0] == young


def test_idle_collects_cycles_that_reached_the_old_generation(pacing: CollectorPacing) -> None:
    node = Node()
    alive = weakref.ref(node)
    gc.collect(1)  # node survives into the old generation ...
    del node  # ... and becomes garbage there
    _churn()
    assert alive() is not None  # nothing automatic collected it
    pacing.on_idle()
    assert alive() is None


def test_overdue_collection_between_steps(pacing: CollectorPacing) -> None:
    node = Node()
    alive = weakref.ref(node)
    gc.collect(1)
    del node
    pacing.between_steps()
    assert alive() is not None  # not yet due
    pacing.max_interval_s = 0.0
    pacing.between_steps()
    assert alive() is None


def test_nothing_is_collected_while_paused_and_collection_resumes_after() -> None:
    gc.freeze()
    gc.collect()
    try:
        with CollectionClock() as clock, collector_paused():
            _churn()
        assert sum(clock.counts) == 0
        assert gc.isenabled()
        with CollectionClock() as clock:
            _churn()
        assert clock.counts[0] > 0  # the control: the same churn collects outside
    finally:
        gc.unfreeze()


def test_a_pause_inside_a_disabled_collector_leaves_it_disabled() -> None:
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_clock_counts_collections_by_generation_and_stops() -> None:
    with CollectionClock() as clock:
        gc.collect(0)
        gc.collect(2)
    gc.collect(2)  # after the clock stopped
    assert clock.counts == [1, 0, 1]
    assert clock.seconds[2] > 0
    assert "2 collections (1 full:" in clock.describe()
