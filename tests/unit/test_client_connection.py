"""The client's I/O thread against engines that refuse it at the handshake."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import zmq

from cbpipe.client import AsyncClient, Client, EngineError
from cbpipe.client import async_client as async_client_module
from cbpipe.client import client as client_module
from cbpipe.protocol.security import CurveKeys


@pytest.fixture
def curve_engine_address() -> Iterator[str]:
    """A socket that speaks CURVE with the key "k3y", as an engine with --api-key does."""
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    CurveKeys.from_api_key("k3y").make_server(server)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    server.close(linger=0)
    context.term()


@pytest.mark.parametrize("api_key", [None, "wrong"])
def test_a_refused_handshake_fails_the_client_even_when_zeromq_takes_no_frame(
    curve_engine_address: str, api_key: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # When a handshake fails, libzmq may leave the DEALER without a pipe, and a blocking send
    # then never returns: the I/O thread would not read the monitor event that says why, and
    # the client would report a silent engine. ZMQ_IMMEDIATE makes that state certain: no
    # pipe exists until a handshake succeeds, and none will.
    configure = client_module.configure_client_socket

    def without_a_pipe(socket: zmq.Socket, address: str, key: str | None) -> None:
        configure(socket, address, key)
        socket.setsockopt(zmq.IMMEDIATE, 1)

    monkeypatch.setattr(client_module, "configure_client_socket", without_a_pipe)
    monkeypatch.setattr(async_client_module, "configure_client_socket", without_a_pipe)
    with pytest.raises(EngineError, match="api key"):
        Client(curve_engine_address, api_key=api_key, connect_timeout=30)

    async def connect() -> None:
        await AsyncClient.connect(curve_engine_address, api_key=api_key, connect_timeout=30)

    with pytest.raises(EngineError, match="api key"):
        asyncio.run(connect())
