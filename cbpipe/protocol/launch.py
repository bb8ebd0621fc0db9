"""What the launcher hands each child process: settings, addresses, the shared segment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import cached_property

from cbpipe.config import EngineConfig
from cbpipe.protocol.liveness import HeartbeatTable
from cbpipe.protocol.security import new_results_token
from cbpipe.protocol.slots import SlotLayout, SlotLimits


@dataclass(frozen=True)
class EngineAddresses:
    client: str  # scheduler ROUTER, clients connect
    worker_steps: str  # scheduler XPUB -> every worker rank's SUB
    worker_results: str  # every worker rank's PUSH -> scheduler PULL (steps: rank 0 only)

    @classmethod
    def in_directory(cls, run_dir: str, client: str | None) -> EngineAddresses:
        def ipc(name: str) -> str:
            return f"ipc://{os.path.join(run_dir, name)}"

        return cls(client or ipc("client.sock"), ipc("steps.sock"), ipc("results.sock"))


@dataclass(frozen=True)
class Rendezvous:
    """Where the worker ranks of a tensor-parallel run meet (``torch.distributed``'s TCP
    store, on rank 0's host), and how many there are. The launcher picks a free port."""

    master_addr: str
    master_port: int
    world_size: int

    @property
    def init_method(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def worker_names(tensor_parallel_size: int) -> tuple[str, ...]:
    """The worker processes' names, rank by rank: ``worker`` alone without tensor
    parallelism (as always), ``worker0``..``workerN-1`` with it."""
    if tensor_parallel_size == 1:
        return ("worker",)
    return tuple(f"worker{rank}" for rank in range(tensor_parallel_size))


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
    rendezvous: Rendezvous | None = None  # with --tensor-parallel-size > 1 only
    # Every frame on the results socket carries it (``security.seal``); others are ignored.
    results_token: bytes = field(default_factory=new_results_token, repr=False)

    @property
    def worker_names(self) -> tuple[str, ...]:
        return worker_names(self.config.worker.tensor_parallel_size)

    def with_client_address(self, client: str) -> RunSpec:
        """The same run, its clients' address as the scheduler bound it (the port it chose
        for ``tcp://HOST:0``), for the children that start after it."""
        if client == self.addresses.client:
            return self
        return replace(self, addresses=replace(self.addresses, client=client))

    @cached_property
    def layout(self) -> SlotLayout:
        return SlotLayout.build(self.slot_limits, self.num_slots)

    def heartbeats(self, buffer: memoryview) -> HeartbeatTable:
        return HeartbeatTable(buffer, self.process_names)
