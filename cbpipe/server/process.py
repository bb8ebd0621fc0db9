"""An HTTP server process: one of ``--api-server-count``, started by the launcher once the
scheduler is ready, serving on the listening socket the launcher opened (all of them share
it; the kernel hands each connection to one).

Nothing at module level imports prometheus_client: its multiprocess mode is chosen by an
environment variable read when it is first imported, and ``server_main`` sets it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from multiprocessing.connection import Connection

import uvicorn

from cbpipe.logs import setup_logging
from cbpipe.protocol.launch import RunSpec
from cbpipe.protocol.shm import AttachedSegment

log = logging.getLogger("cbpipe.server")

CONNECT_TIMEOUT_S = 60.0
GRACEFUL_SHUTDOWN_S = 2  # connections still open this long after the stop begins are cut
HEARTBEAT_INTERVAL_S = 0.5
SHUTDOWN_REASON = "the server is shutting down"


def listen(host: str, port: int) -> socket.socket:
    """The listening socket every server process accepts on (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def metrics_dir(spec: RunSpec) -> str:
    return os.path.join(spec.run_dir, "metrics")


def server_main(spec: RunSpec, ready: Connection, sock: socket.socket, index: int) -> None:
    """Entry point of server process ``index`` (started by the launcher)."""
    os.makedirs(metrics_dir(spec), exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir(spec)
    name = f"api_server_{index}"
    setup_logging(spec.config.log_level, name)
    segment = AttachedSegment(spec.segment_name, spec.layout.segment_nbytes)
    heartbeats = spec.heartbeats(segment.buf)
    try:
        asyncio.run(_serve(spec, ready, sock, heartbeats.beater(name), first=index == 0))
    except Exception:
        log.exception("the HTTP server failed")
        with contextlib.suppress(OSError):
            ready.send(("failed", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        heartbeats.close()
        segment.close()


async def _beat(beat: Callable[[], None]) -> None:
    """The launcher's sign of life from this event loop: a loop blocked for longer than
    --liveness-timeout-s ends the run, as a stuck scheduler does."""
    while True:
        beat()
        await asyncio.sleep(HEARTBEAT_INTERVAL_S)


async def _serve(
    spec: RunSpec, ready: Connection, sock: socket.socket, beat: Callable[[], None], first: bool
) -> None:
    from cbpipe.client import AsyncClient
    from cbpipe.models import resolve_model
    from cbpipe.server.app import build_app
    from cbpipe.server.common import SamplingDefaults, ServerState
    from cbpipe.server.metrics import ServerMetrics
    from cbpipe.server.text import Text
    from cbpipe.server.tools import PARSERS

    server_config = spec.config.server
    source = resolve_model(
        spec.config.model.model, spec.config.model.revision, spec.config.model.tokenizer
    )
    name = server_config.served_model_name or spec.config.model.model
    text = Text.load(source.tokenizer_path, name, server_config.chat_template)
    # The server makes its streams' text itself: the engine's one scheduling thread sends
    # token ids, and the servers' processes share the decoding.
    client = await AsyncClient.connect(
        spec.addresses.client,
        connect_timeout=CONNECT_TIMEOUT_S,
        api_key=spec.config.api_key,
        tokenizer=text.tokenizer,
    )
    try:
        defaults = SamplingDefaults.chosen(server_config.generation_config, source.path)
        if first and (recommended := defaults.describe()):
            log.info("requests that leave them out get the model's sampling defaults: %s "
                     "(--generation-config none: OpenAI's)", recommended)  # fmt: skip
        state = ServerState(
            client,
            text,
            ServerMetrics(name),
            name,
            api_key=spec.config.api_key,
            created=int(time.time()),
            defaults=defaults,
            tool_parser=(
                PARSERS[server_config.tool_call_parser]()
                if server_config.enable_auto_tool_choice and server_config.tool_call_parser
                else None
            ),
        )
        config = uvicorn.Config(
            build_app(state),
            log_level=spec.config.log_level,
            access_log=spec.config.log_level == "debug",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            lifespan="off",
        )
        server = _Server(
            config,
            on_started=lambda: ready.send(("ready", f"http={url_of(sock)}")),
            # Every open request ends now, as the README promises a request whose engine
            # went away: a 503, or an error event before a stream's [DONE]. Left to
            # uvicorn's graceful timeout, they would be cut (a 500, a stream without end).
            on_stopping=lambda: client.close(reason=SHUTDOWN_REASON),
        )
        beating = asyncio.ensure_future(_beat(beat))
        try:
            await server.serve(sockets=[sock])
        finally:
            beating.cancel()
    finally:
        await client.close()


class _Server(uvicorn.Server):
    """uvicorn's server, reporting ready once it accepts, ending its open requests as it
    begins to stop, and stopping on SIGTERM only (the launcher decides how to stop; Ctrl-C
    reaches the whole group)."""

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        on_started: Callable[[], None],
        on_stopping: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(config)
        self._on_started = on_started
        self._on_stopping = on_stopping

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            self._on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._on_stopping()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = signal.signal(signal.SIGTERM, self.handle_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
