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
    assert deadline.timeout_s == 600.0  # nothing to go by before the first step
    deadline.record(0.003)
    assert deadline.timeout_s == 10.0
    deadline.record(2.0)  # say, a CPU step of a large model
    assert deadline.timeout_s == STEP_DEADLINE_FACTOR * 2.0


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
