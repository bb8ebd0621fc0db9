"""The scheduler's sockets: which connection to its results socket is the worker's."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
import zmq.utils.monitor

from cbpipe.config import EngineConfig
from cbpipe.launcher import plan_layout, resolve_limits
from cbpipe.protocol.launch import EngineAddresses, RunSpec
from cbpipe.scheduler.process import EngineSockets

EVENT_BOUND_S = 30.0  # a local connection takes milliseconds; generous for a loaded machine


@pytest.fixture
def spec() -> Iterator[RunSpec]:
    """A run's addresses, in a folder of the launcher's kind (short: an ipc path is at most
    107 bytes, and pytest's ``tmp_path`` can be longer)."""
    config = resolve_limits(EngineConfig())
    with tempfile.TemporaryDirectory(prefix="cbpipe-test-") as run_dir:
        yield RunSpec(
            config,
            EngineAddresses.in_directory(run_dir, None),
            segment_name="unused",
            slot_limits=plan_layout(config).limits,
            num_slots=1,
            launcher_pid=os.getpid(),
            run_dir=run_dir,
            process_names=("worker", "scheduler"),
        )


def test_a_worker_that_connected_before_the_monitor_could_is_still_heard_of(
    spec: RunSpec,
) -> None:
    """The worker starts before the scheduler and retries its connection until the results
    socket exists. The scheduler's loop takes the first connections its monitor reports for
    the workers'; a worker accepted between the socket's bind and the monitor's start went
    unreported, so the first other connection (a stray process's) was taken for it, and that
    connection's end failed the engine with "the worker process exited" while the worker ran.
    Here the scheduler is slow just after the bind (a loaded machine), long enough for the
    worker's connection to be accepted."""
    context = zmq.Context()
    worker = context.socket(zmq.PUSH)
    worker.setsockopt(zmq.LINGER, 0)
    worker.setsockopt(zmq.RECONNECT_IVL, 10)
    handshakes = worker.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    worker.connect(spec.addresses.worker_results)  # before the bind, as the workers do
    scheduler_context = SlowBindContext(spec.addresses.worker_results, handshakes)
    sockets = EngineSockets.bind(scheduler_context, spec)
    try:
        assert sockets.monitor.poll(EVENT_BOUND_S * 1000), "no connection reported"
        event = zmq.utils.monitor.recv_monitor_message(sockets.monitor)
        assert event["event"] == zmq.EVENT_ACCEPTED
    finally:
        sockets.close()
        worker.disable_monitor()
        handshakes.close(linger=0)
        worker.close()
        scheduler_context.term()
        context.term()


class SlowBindSocket(zmq.Socket):
    """A socket whose bind to one address returns only once a connection to it that was
    waiting has been accepted (its handshake done): a scheduler descheduled right after the
    bind, on a machine with more processes than cores."""

    def bind(self, addr: str) -> Any:
        bound = super().bind(addr)
        context = self.context
        assert isinstance(context, SlowBindContext)
        address, handshakes = context.slow_bind_of
        if addr == address:
            assert handshakes.poll(EVENT_BOUND_S * 1000), "the connection was never accepted"
            handshakes.recv_multipart()
        return bound


class SlowBindContext(zmq.Context):
    """Makes ``SlowBindSocket``s: their bind to ``address`` waits for a handshake that
    ``handshakes`` (the connecting socket's monitor) reports."""

    _socket_class = SlowBindSocket
    slow_bind_of: tuple[str, zmq.Socket]  # declared here: pyzmq takes others for options

    def __init__(self, address: str, handshakes: zmq.Socket) -> None:
        super().__init__()
        self.slow_bind_of = (address, handshakes)
