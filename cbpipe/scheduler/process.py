"""The scheduler process: sockets, the worker handshake, then the engine loop."""

from __future__ import annotations

import logging
import signal
import traceback
from multiprocessing.connection import Connection
from types import FrameType

import zmq
import zmq.utils.monitor

from cbpipe.logs import setup_logging
from cbpipe.models import resolve_model
from cbpipe.protocol.launch import RunSpec
from cbpipe.protocol.messages import WorkerFailed, WorkerReady, decode
from cbpipe.protocol.shm import AttachedSegment
from cbpipe.scheduler.block_manager import BlockManager
from cbpipe.scheduler.core import Scheduler
from cbpipe.scheduler.frontend import Frontend, ModelInfo
from cbpipe.scheduler.loop import EngineLoop, WorkerLost
from cbpipe.scheduler.packer import BatchPacker
from cbpipe.trace import write_chrome_trace

log = logging.getLogger("cbpipe.scheduler")

# Roomy: thousands of jobs stream tokens at once, and a dropped frame is a lost token.
CLIENT_HWM = 1_000_000


def scheduler_main(spec: RunSpec, ready: Connection) -> None:
    """Entry point of the scheduler process (started by the launcher)."""
    setup_logging(spec.config.log_level, "scheduler")
    context = zmq.Context()
    sockets = _bind(context, spec)
    segment = AttachedSegment(spec.segment_name, spec.layout.segment_nbytes)
    loop: EngineLoop | None = None
    exit_code = 0
    try:
        loop = _start(spec, sockets, segment)
        loop.collector.start()
        ready.send(("ready", spec.addresses.client))
        _stop_on_signals(loop)
        loop.run()
        loop.shutdown_worker()
    except WorkerLost as exc:
        log.error("%s", exc)
        if loop is not None:
            loop.frontend.fail_everything(str(exc))
        exit_code = 1
    except Exception:
        log.exception("scheduler failed")
        if loop is None:
            ready.send(("failed", traceback.format_exc()))
        exit_code = 1
    finally:
        if loop is not None and loop.records is not None and spec.config.scheduler.trace:
            write_chrome_trace(loop.records, spec.config.scheduler.trace)
            log.info("wrote %d steps to %s", len(loop.records), spec.config.scheduler.trace)
        for socket in sockets.values():
            socket.close(linger=500)  # lets final replies (errors, finishes) go out
        segment.close()
        context.term()
    raise SystemExit(exit_code)


def _bind(context: zmq.Context, spec: RunSpec) -> dict[str, zmq.Socket]:
    clients = context.socket(zmq.ROUTER)
    clients.setsockopt(zmq.SNDHWM, CLIENT_HWM)
    clients.setsockopt(zmq.RCVHWM, CLIENT_HWM)
    clients.bind(spec.addresses.client)
    steps = context.socket(zmq.PUSH)
    steps.bind(spec.addresses.worker_steps)
    results = context.socket(zmq.PULL)
    results.bind(spec.addresses.worker_results)
    monitor = results.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    return {"clients": clients, "steps": steps, "results": results, "monitor": monitor}


def _start(spec: RunSpec, sockets: dict[str, zmq.Socket], segment: AttachedSegment) -> EngineLoop:
    config = spec.config
    hello = _wait_for_worker(sockets["results"], config.ready_timeout_s)
    source = resolve_model(config.model.model)
    tokenizer = None
    if source.tokenizer_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_path)
    max_model_len = config.model.max_model_len
    assert max_model_len is not None  # the launcher resolves it
    model = ModelInfo(
        name=hello.model,
        vocab_size=hello.vocab_size,
        max_total_tokens=min(max_model_len, hello.num_blocks * config.cache.block_size),
        eos_token_ids=frozenset(hello.eos_token_ids),
    )
    blocks = BlockManager(hello.num_blocks, config.cache.block_size)
    scheduler = Scheduler(
        blocks,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_batch_tokens=config.scheduler.max_batch_tokens,
    )
    packer = BatchPacker(segment.buf, spec.layout, config.cache.block_size)
    frontend = Frontend(sockets["clients"], scheduler, model, tokenizer)
    log.info(
        "serving %s (%s on %s), %d KV blocks",
        hello.model,
        hello.dtype,
        hello.device,
        hello.num_blocks,
    )
    return EngineLoop(
        scheduler=scheduler,
        packer=packer,
        frontend=frontend,
        client_socket=sockets["clients"],
        steps_socket=sockets["steps"],
        results_socket=sockets["results"],
        worker_monitor=sockets["monitor"],
        max_in_flight=config.scheduler.max_in_flight,
        pack_delay_s=config.scheduler.debug_scheduler_delay_ms / 1e3,
        record_steps=config.scheduler.trace is not None,
    )


def _wait_for_worker(results: zmq.Socket, timeout_s: float) -> WorkerReady:
    if not results.poll(int(timeout_s * 1e3)):
        raise TimeoutError(f"the worker did not report ready within {timeout_s:.0f} s")
    message = decode(results.recv(), expected=(WorkerReady, WorkerFailed))
    if isinstance(message, WorkerFailed):
        raise RuntimeError(f"worker failed to start: {message.message}")
    assert isinstance(message, WorkerReady)
    return message


def _stop_on_signals(loop: EngineLoop) -> None:
    def stop(signum: int, frame: FrameType | None) -> None:
        loop.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
