"""How the engine's processes and its clients notice that a peer stopped answering.

Three mechanisms, each for what the others cannot see:

- ZeroMQ heartbeats on every client connection (``HEARTBEAT_*``): ZeroMQ's own I/O threads
  ping the peer, so a process that is stopped (SIGSTOP) or gone (a dead host) drops its
  connections within ``HEARTBEAT_TIMEOUT_MS``. A client then fails its jobs with
  ``EngineError``; the scheduler, whose ROUTER socket refuses sends to peers it no longer has,
  cancels the jobs of a client the next time it has tokens for them.
- A heartbeat table at the start of the shared-memory segment (``HeartbeatTable``): each child
  stamps its entry from its main loop, so a process that is alive but stuck (a blocked loop,
  a stopped process on a machine where sockets stay up) shows as a stale stamp. The scheduler
  watches the worker's entry, the launcher everyone's.
- Per-step deadlines in the scheduler (``scheduler/loop.py``): a worker whose main loop runs
  but whose device never finishes a step (a hung kernel) is noticed there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
# Bytes at the start of the segment, before the slots: one 64-byte line per process.
TABLE_NBYTES = 4096
_LINE = 64


class HeartbeatTable:
    """One monotonic-clock stamp (ns) per named process, in shared memory."""

    def __init__(self, buffer: memoryview, names: Sequence[str]) -> None:
        if len(names) * _LINE > TABLE_NBYTES:
            raise ValueError(f"{len(names)} processes do not fit the heartbeat table")
        self.names = list(names)
        self._stamps = [
            np.frombuffer(buffer, dtype=np.int64, count=1, offset=i * _LINE)
            for i in range(len(names))
        ]

    def beat(self, name: str) -> None:
        self._stamps[self.names.index(name)][0] = time.monotonic_ns()

    def beater(self, name: str) -> _Beater:
        """A cheap ``beat()`` for one process's loop."""
        return _Beater(self._stamps[self.names.index(name)])

    def close(self) -> None:
        """Drop the views, so the segment's mapping can be closed."""
        self._stamps.clear()

    def silent_for_s(self, name: str) -> float | None:
        """Seconds since ``name`` last beat; None if it never did."""
        stamp = int(self._stamps[self.names.index(name)][0])
        return None if stamp == 0 else (time.monotonic_ns() - stamp) / 1e9


class _Beater:
    def __init__(self, stamp: np.ndarray) -> None:
        self._stamp = stamp

    def __call__(self) -> None:
        self._stamp[0] = time.monotonic_ns()
