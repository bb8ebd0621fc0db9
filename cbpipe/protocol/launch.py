"""What the launcher hands each child process: settings, addresses, the shared segment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

from cbpipe.config import EngineConfig
from cbpipe.protocol.liveness import HeartbeatTable
from cbpipe.protocol.slots import SlotLayout, SlotLimits


@dataclass(frozen=True)
class EngineAddresses:
    client: str  # scheduler ROUTER, clients connect
    worker_steps: str  # scheduler PUSH -> worker PULL
    worker_results: str  # worker PUSH -> scheduler PULL

    @classmethod
    def in_directory(cls, run_dir: str, client: str | None) -> EngineAddresses:
        def ipc(name: str) -> str:
            return f"ipc://{os.path.join(run_dir, name)}"

        return cls(client or ipc("client.sock"), ipc("steps.sock"), ipc("results.sock"))


@dataclass(frozen=True)
class RunSpec:
    """Everything a child needs to join one engine run."""

    config: EngineConfig
    addresses: EngineAddresses
    segment_name: str
    slot_limits: SlotLimits
    num_slots: int
    launcher_pid: int
    run_dir: str  # the ipc sockets' folder, removed with the run
    process_names: tuple[str, ...]  # the children, in the order of the heartbeat table

    @cached_property
    def layout(self) -> SlotLayout:
        return SlotLayout.build(self.slot_limits, self.num_slots)

    def heartbeats(self, buffer: memoryview) -> HeartbeatTable:
        return HeartbeatTable(buffer, self.process_names)
