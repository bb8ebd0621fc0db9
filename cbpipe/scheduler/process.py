"""The scheduler process: sockets, the worker handshake, then the engine loop."""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

import zmq
import zmq.utils.monitor
from zmq.auth.thread import ThreadAuthenticator

from cbpipe.logs import setup_logging
from cbpipe.models import ModelSource, resolve_model
from cbpipe.protocol.launch import RunSpec
from cbpipe.protocol.liveness import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS
from cbpipe.protocol.messages import MAX_FRAME_BYTES, WorkerFailed, WorkerReady, decode
from cbpipe.protocol.security import CurveKeys, reachable_address, uses_curve
from cbpipe.protocol.shm import AttachedSegment
from cbpipe.scheduler.block_manager import BlockManager
from cbpipe.scheduler.core import Scheduler
from cbpipe.scheduler.frontend import Frontend, ModelInfo
from cbpipe.scheduler.loop import EngineLoop, Liveness, WorkerLost, worker_frame
from cbpipe.scheduler.packer import BatchPacker
from cbpipe.scheduler.structured import Grammars, StructuredOutputUnavailable
from cbpipe.trace import write_chrome_trace

log = logging.getLogger("cbpipe.scheduler")

# Send side roomy: thousands of jobs stream tokens at once, and a dropped frame is a lost
# token. Receive side bounded: a client that floods the engine is slowed down by ZeroMQ's
# back-pressure instead of queueing without end.
CLIENT_SNDHWM = 1_000_000
CLIENT_RCVHWM = 4096
# A frame must hold a prompt of the longest sequence served: token ids take up to 9 bytes
# each in msgpack, text up to a few bytes per character and a few characters per token.
_FRAME_BASE = 64 * 1024
_FRAME_PER_TOKEN = 64
# Between the worker and the scheduler: a few hundred bytes a message.
WORKER_MAXMSGSIZE = 64 * 1024
# How long a closing socket may still deliver its last frames (errors, finishes).
SOCKET_LINGER_MS = 500


def frame_limit(max_model_len: int) -> int:
    return min(MAX_FRAME_BYTES, _FRAME_BASE + _FRAME_PER_TOKEN * max_model_len)


def scheduler_main(spec: RunSpec, ready: Connection) -> None:
    """Entry point of the scheduler process (started by the launcher).

    However the loop ends, it ends the orderly way: every job fails with the engine's own
    message and the worker is told to stop; the exit code says whether it was a failure."""
    setup_logging(spec.config.log_level, "scheduler")
    context = zmq.Context()
    # The default for every socket of the context, from its making: a linger given to
    # close() once the context is ending is refused (silently), and ZeroMQ's own default
    # waits for ever for frames to a peer that is gone.
    context.setsockopt(zmq.LINGER, SOCKET_LINGER_MS)
    try:
        sockets = EngineSockets.bind(context, spec)
    except BindError as exc:  # the launcher says so
        ready.send(("failed", str(exc)))
        context.term()
        raise SystemExit(1) from None
    segment = AttachedSegment(spec.segment_name, spec.layout.segment_nbytes)
    loop: EngineLoop | None = None
    exit_code = 0
    try:
        loop = _start(spec, sockets, segment)
        loop.start_collector()
        ready.send(("ready", sockets.client_address))
        _stop_on_signals(loop)
        loop.run()
    except Exception as exc:
        if isinstance(exc, WorkersNotStarted):  # the workers said why, or the launcher will
            log.error("%s", exc)
            ready.send(("failed", str(exc)))
        elif loop is None:
            log.exception("scheduler failed to start")
            ready.send(("failed", traceback.format_exc()))
        elif isinstance(exc, WorkerLost):
            log.error("%s", exc)
            loop.frontend.fail_everything(str(exc))
        else:
            log.exception("scheduler failed")
            loop.frontend.fail_everything(f"the scheduler failed: {type(exc).__name__}: {exc}")
        exit_code = 1
    finally:
        if loop is not None:
            loop.shutdown_worker()
        if loop is not None and loop.records is not None and spec.config.scheduler.trace:
            write_chrome_trace(loop.records, spec.config.scheduler.trace)
            log.info("wrote %d steps to %s", len(loop.records), spec.config.scheduler.trace)
        if loop is not None and loop.frontend.preparation is not None:
            loop.frontend.preparation.close()
        sockets.close()
        segment.close()
        context.term()
    raise SystemExit(exit_code)


class BindError(Exception):
    """An address the scheduler cannot listen on (taken by another process, say)."""


class WorkersNotStarted(RuntimeError):
    """A worker rank failed to start, or not all reported within the start-up limit."""


@dataclasses.dataclass
class EngineSockets:
    """The scheduler's sockets: clients (ROUTER), the steps to every worker rank (XPUB), the
    ranks' results (PULL) and that socket's connection monitor; with an api key on a tcp
    address, the thread of ZeroMQ's that answers the clients' CURVE handshakes."""

    clients: zmq.Socket
    steps: zmq.Socket
    results: zmq.Socket
    monitor: zmq.Socket
    client_address: str  # where clients reach ``clients``: with the port chosen, if asked
    authenticator: ThreadAuthenticator | None = None

    @classmethod
    def bind(cls, context: zmq.Context, spec: RunSpec) -> EngineSockets:
        max_model_len = spec.config.model.max_model_len
        assert max_model_len is not None  # the launcher resolves it
        clients = context.socket(zmq.ROUTER)
        clients.setsockopt(zmq.SNDHWM, CLIENT_SNDHWM)
        clients.setsockopt(zmq.RCVHWM, CLIENT_RCVHWM)
        # Larger frames cost their sender the connection, before they are read into memory.
        clients.setsockopt(zmq.MAXMSGSIZE, frame_limit(max_model_len))
        # Sends to a client that is gone fail (rather than vanish): its jobs are then cancelled.
        clients.setsockopt(zmq.ROUTER_MANDATORY, 1)
        clients.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        clients.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        authenticator = None
        api_key = spec.config.api_key
        if api_key is not None and uses_curve(spec.addresses.client, api_key):
            authenticator = _require_curve(context, clients, CurveKeys.from_api_key(api_key))
        try:
            clients.bind(spec.addresses.client)
        except zmq.ZMQError as exc:
            if authenticator is not None:
                authenticator.stop()
            clients.close(linger=0)
            reason = zmq.strerror(exc.errno) if exc.errno is not None else str(exc)
            raise BindError(
                f"cannot listen for clients on {spec.addresses.client}: {reason} "
                "(another cbpipe-launch or program may hold it: choose another --address)"
            ) from None
        # Every step goes to every worker rank, so a publisher: XPUB rather than PUB, because
        # it hands us each rank's subscription, and the handshake waits for all of them (a PUB
        # drops what it sends before a subscription arrives: ZeroMQ's slow joiner).
        steps = context.socket(zmq.XPUB)
        steps.setsockopt(zmq.XPUB_VERBOSE, 1)  # every rank's subscription, not only the first
        steps.bind(spec.addresses.worker_steps)
        results = context.socket(zmq.PULL)
        results.setsockopt(zmq.MAXMSGSIZE, WORKER_MAXMSGSIZE)
        # The monitor before the bind: the workers start first and retry their connection
        # until the socket exists, and an acceptance before the monitor is reported to no one.
        # The loop takes the first connections it hears of for the workers', so the first
        # other one (a stray process's) was taken for the worker's, and its end for the
        # worker's exit: the engine stopped.
        monitor = results.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        results.bind(spec.addresses.worker_results)
        client_address = reachable_address(
            spec.addresses.client, clients.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        return cls(clients, steps, results, monitor, client_address, authenticator)

    def close(self) -> None:
        """Close the sockets, the results socket's monitor first and detached before it
        closes, then stop the authenticator, whose own socket would otherwise keep
        ``context.term()`` waiting.

        A worker's connection that ends once the monitor's reader is gone would block
        ZeroMQ's I/O thread in handing over that event, and ``context.term()`` with it
        (libzmq#2083, libzmq#3575: the order libzmq asks for, though no hang here has been
        traced to it).
        """
        self.results.disable_monitor()
        self.monitor.close(linger=0)
        for socket in (self.clients, self.steps, self.results):
            socket.close(linger=SOCKET_LINGER_MS)  # lets final replies go out
        if self.authenticator is not None:
            self.authenticator.stop()


def _require_curve(
    context: zmq.Context, socket: zmq.Socket, keys: CurveKeys
) -> ThreadAuthenticator:
    """Encrypt the socket's traffic, and accept only clients whose key comes from the same
    api key. The authenticator is a thread of ZeroMQ's that answers handshakes: it runs
    until the sockets close."""
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback("*", _AllowKey(keys.client_public))
    keys.make_server(socket)
    return authenticator


class _AllowKey:
    def __init__(self, public_key: bytes) -> None:
        self.public_key = public_key

    def callback(self, domain: str, key: bytes) -> bool:  # key: Z85, as pyzmq passes it
        allowed = key == self.public_key
        if not allowed:
            log.warning("refused a client without the api key")
        return allowed


def _load_text_tools(source: ModelSource, mask_tokens: int) -> tuple[Any | None, Grammars | str]:
    """The model's tokenizer, and structured output's compiler with llguidance's view of it
    built (seconds for a vocabulary of 128 k tokens, most of it holding the GIL: done while
    the workers load, never on the step loop) or why there is none."""
    if source.tokenizer_path is None:
        return None, "the model has no tokenizer: structured output needs one"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_path)
    if len(tokenizer) > mask_tokens:  # its ids would lie outside the model's embeddings
        raise ValueError(
            f"the tokenizer in {source.tokenizer_path} has {len(tokenizer)} tokens, more than "
            f"the model's {mask_tokens}"
        )
    grammars = Grammars(tokenizer, mask_tokens, source.eos_token_ids)
    try:
        grammars.llg_tokenizer()
    except StructuredOutputUnavailable as exc:
        log.warning("%s; requests that ask for it are refused", exc)
        return tokenizer, str(exc)
    return tokenizer, grammars


def _start(spec: RunSpec, sockets: EngineSockets, segment: AttachedSegment) -> EngineLoop:
    config = spec.config
    source = resolve_model(config.model.model, config.model.revision, config.model.tokenizer)
    mask_tokens = spec.layout.limits.vocab_size
    with ThreadPoolExecutor(1, thread_name_prefix="text-tools") as pool:
        text_tools = pool.submit(_load_text_tools, source, mask_tokens)
        hello = _wait_for_workers(
            sockets.results,
            spec.results_token,
            sockets.steps,
            len(spec.worker_names),
            config.ready_timeout_s,
        )
        tokenizer, grammars = text_tools.result()
    if isinstance(grammars, Grammars) and mask_tokens != hello.vocab_size:
        grammars = (  # the slots' masks are sized from the model's configuration
            f"the slots' token masks cover {mask_tokens} tokens, the model has "
            f"{hello.vocab_size}: structured output is off"
        )
    max_model_len = config.model.max_model_len
    assert max_model_len is not None  # the launcher resolves it
    model = ModelInfo(
        name=hello.model,
        vocab_size=hello.vocab_size,
        max_total_tokens=min(max_model_len, hello.num_blocks * config.cache.block_size),
        eos_token_ids=frozenset(hello.eos_token_ids),
    )
    blocks = BlockManager(
        hello.num_blocks, config.cache.block_size, prefix_caching=config.cache.prefix_caching
    )
    scheduler = Scheduler(
        blocks,
        max_num_seqs=hello.max_num_seqs,
        max_batch_tokens=hello.max_batch_tokens,
    )
    packer = BatchPacker(segment.buf, spec.layout, config.cache.block_size)
    frontend = Frontend(
        sockets.clients,
        scheduler,
        model,
        tokenizer,
        max_waiting_requests=config.scheduler.max_waiting_requests,
        max_frame_bytes=frame_limit(max_model_len),
        grammars=grammars,
    )
    log.info(
        "serving %s (%s on %s), %d KV blocks, %d sequences and %d tokens a step",
        hello.model,
        hello.dtype,
        hello.device,
        hello.num_blocks,
        hello.max_num_seqs,
        hello.max_batch_tokens,
    )
    return EngineLoop(
        scheduler=scheduler,
        packer=packer,
        frontend=frontend,
        client_socket=sockets.clients,
        steps_socket=sockets.steps,
        results_socket=sockets.results,
        results_token=spec.results_token,
        worker_monitor=sockets.monitor,
        max_in_flight=config.scheduler.max_in_flight,
        pack_delay_s=config.scheduler.debug_scheduler_delay_ms / 1e3,
        heartbeats=spec.heartbeats(segment.buf),
        worker_names=spec.worker_names,
        liveness=Liveness(
            config.liveness_timeout_s, config.scheduler.step_timeout_s, config.ready_timeout_s
        ),
        record_steps=config.scheduler.trace is not None,
    )


def _wait_for_workers(
    results: zmq.Socket, token: bytes, steps: zmq.Socket, num_ranks: int, timeout_s: float
) -> WorkerReady:
    """Every worker rank's ``WorkerReady`` and its subscription to the steps, then one
    report for all: rank 0's, with the fewest KV blocks any rank holds (the ranks agree
    on the count before they allocate; the minimum is what all can hold in any case) and
    the smallest step limits (each rank's device chose its own)."""
    deadline = time.monotonic() + timeout_s
    reports: dict[int, WorkerReady] = {}
    subscribed = 0
    poller = zmq.Poller()
    poller.register(results, zmq.POLLIN)
    poller.register(steps, zmq.POLLIN)
    while len(reports) < num_ranks or subscribed < num_ranks:
        left_ms = int((deadline - time.monotonic()) * 1e3)
        events = dict(poller.poll(max(left_ms, 0))) if left_ms > 0 else {}
        if not events:
            raise WorkersNotStarted(
                f"{len(reports)} of {num_ranks} worker rank(s) reported ready and {subscribed} "
                f"subscribed to the steps within {timeout_s:.0f} s"
            )
        if steps in events and steps.recv()[:1] == b"\x01":  # a subscription, not its end
            subscribed += 1
        if results in events:
            frame = worker_frame(token, results.recv())
            if frame is None:
                continue
            message = decode(frame, expected=(WorkerReady, WorkerFailed))
            if isinstance(message, WorkerFailed):
                raise WorkersNotStarted(f"worker failed to start: {message.message}")
            assert isinstance(message, WorkerReady)
            reports[message.rank] = message
            log.debug("worker rank %d of %d ready: %s", message.rank, num_ranks, message)
    if sorted(reports) != list(range(num_ranks)):
        raise RuntimeError(f"worker ranks {sorted(reports)} reported, expected 0..{num_ranks - 1}")
    return dataclasses.replace(
        reports[0],
        num_blocks=min(r.num_blocks for r in reports.values()),
        max_batch_tokens=min(r.max_batch_tokens for r in reports.values()),
        max_num_seqs=min(r.max_num_seqs for r in reports.values()),
    )


def _stop_on_signals(loop: EngineLoop) -> None:
    def stop(signum: int, frame: FrameType | None) -> None:
        loop.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
