"""Heartbeats, step deadlines and the removal of dead launches' leftovers."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cbpipe import leftovers
from cbpipe.protocol.liveness import TABLE_NBYTES, HeartbeatTable
from cbpipe.scheduler.loop import STEP_DEADLINE_FACTOR, StepDeadline


def test_heartbeats_are_per_process_and_age() -> None:
    buffer = memoryview(bytearray(TABLE_NBYTES))
    table = HeartbeatTable(buffer, ["worker", "scheduler"])
    assert table.silent_for_s("worker") is None  # never beat: not watched yet
    table.beater("worker")()
    time.sleep(0.05)
    table.beat("scheduler")
    worker, scheduler = table.silent_for_s("worker"), table.silent_for_s("scheduler")
    assert worker is not None and scheduler is not None and worker > scheduler >= 0
    # Another view of the same memory (another process) sees the same stamps.
    assert HeartbeatTable(buffer, ["worker", "scheduler"]).silent_for_s("worker") is not None


def test_step_deadline_follows_the_slowest_recent_step() -> None:
    deadline = StepDeadline(min_timeout_s=10.0, first_timeout_s=600.0)
    assert deadline.timeout_s(1) == 600.0  # nothing to go by before the first step
    deadline.record(0.003, 1)
    assert deadline.timeout_s(1) == 10.0
    deadline.record(2.0, 1)  # say, a CPU step of a large model
    assert deadline.timeout_s(1) == STEP_DEADLINE_FACTOR * 2.0


def test_step_deadline_grows_with_the_steps_rows() -> None:
    """A burst of prompts on a CPU: a step of 2,048 rows after warm-up steps of one row took
    50 s, 30 times the slowest of them, and the engine was failed as stuck."""
    deadline = StepDeadline(min_timeout_s=10.0, first_timeout_s=600.0)
    deadline.record(1.7, 16)
    deadline.record(0.2, 1)
    # The single row's 0.2 s says more of 2,048 rows than the 16 rows' 1.7 s do.
    assert deadline.timeout_s(2048) == pytest.approx(STEP_DEADLINE_FACTOR * 0.2 * 2048)
    # Fewer rows than a recent step are allowed as long as it took, no less.
    assert deadline.timeout_s(4) == pytest.approx(STEP_DEADLINE_FACTOR * 1.7)
    # On a GPU: a prefill step of 8,192 rows after decode steps of 32 at 5 ms.
    gpu = StepDeadline(min_timeout_s=10.0, first_timeout_s=600.0)
    for _ in range(64):
        gpu.record(0.005, 32)
    assert gpu.timeout_s(32) == 10.0
    assert gpu.timeout_s(8192) == pytest.approx(STEP_DEADLINE_FACTOR * 0.005 * 256)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_dead_launches_leftovers_are_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryDirectory() as shm, tempfile.TemporaryDirectory() as tmp:
        monkeypatch.setattr(leftovers, "SHM_DIR", shm)
        monkeypatch.setattr(tempfile, "tempdir", tmp)
        dead, alive = dead_pid(), os.getpid()
        dead_segment = Path(shm, f"cbpipe-{dead}-abcd1234")
        live_segment = Path(shm, f"cbpipe-{alive}-abcd1234")
        dead_dir = Path(tmp, f"cbpipe-{dead}-xyz")
        unrelated = Path(tmp, "cbpipe-notes")
        for path in (dead_segment, live_segment, unrelated):
            path.write_bytes(b"x")
        dead_dir.mkdir()
        (dead_dir / "client.sock").write_bytes(b"")
        removed = leftovers.remove_dead_launches()
        assert sorted(removed) == sorted([dead_segment, dead_dir])
        assert live_segment.exists() and unrelated.exists()
        assert not dead_segment.exists() and not dead_dir.exists()
