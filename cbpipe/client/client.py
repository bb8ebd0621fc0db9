"""The client library: ``Client``, ``Job`` and ``Result``.

One background thread per ``Client`` owns the ZeroMQ socket (sockets are not thread-safe):
calls from any thread queue frames for it and wake it through a pipe; it routes replies to
their ``Job`` objects. A socket monitor tells it when the engine's end of the connection goes
away, and every unfinished job then fails with ``EngineError`` instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.utils.monitor

from cbpipe.protocol.messages import (
    MAX_FRAME_BYTES,
    Cancel,
    Error,
    ErrorKind,
    Finished,
    Goodbye,
    Hello,
    Message,
    ProtocolError,
    Submit,
    Tokens,
    Welcome,
    decode,
    encode,
)
from cbpipe.protocol.sampling import SamplingParams

log = logging.getLogger("cbpipe.client")

CLOSE_LINGER_MS = 200  # time to deliver the goodbye to an engine that is still there


class RequestError(ValueError):
    """The engine refused the request; the message says why. Other jobs are unaffected."""


class EngineError(RuntimeError):
    """The engine failed, is gone, or never answered."""


@dataclass(frozen=True)
class Result:
    token_ids: list[int]  # generated tokens only
    text: str | None  # None when the model has no tokenizer
    finish_reason: str  # "stop", "length", "cancelled" or "error"
    num_prompt_tokens: int


@dataclass(eq=False)
class Job:
    """One submitted generation. Thread-safe; ``stream()`` and ``result()`` may be mixed."""

    request_id: int
    _client: Client = field(repr=False)
    _tokens: list[int] = field(default_factory=list, repr=False)
    _result: Result | None = field(default=None, repr=False)
    _error: Exception | None = field(default=None, repr=False)
    _changed: threading.Condition = field(default_factory=threading.Condition, repr=False)

    @property
    def done(self) -> bool:
        with self._changed:
            return self._result is not None or self._error is not None

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the job to finish; raises ``TimeoutError`` after ``timeout`` seconds."""
        with self._changed:
            finished = self._changed.wait_for(
                lambda: self._result is not None or self._error is not None, timeout
            )
            if not finished:
                raise TimeoutError(f"job {self.request_id} not finished after {timeout} s")
            if self._error is not None:
                raise self._error
            assert self._result is not None
            return self._result

    def stream(self, timeout: float | None = None) -> Iterator[int]:
        """Yield generated token ids as they arrive; ``timeout`` bounds each wait."""
        seen = 0
        while True:
            with self._changed:
                ready = self._changed.wait_for(self._news_after(seen), timeout)
                if not ready:
                    raise TimeoutError(f"job {self.request_id}: no token for {timeout} s")
                new, seen = self._tokens[seen:], len(self._tokens)
                error, over = self._error, self._result is not None
            yield from new
            if error is not None:
                raise error
            if over and seen == len(self._tokens):
                return

    def _news_after(self, seen: int) -> Callable[[], bool]:
        def news() -> bool:
            return len(self._tokens) > seen or self._result is not None or self._error is not None

        return news

    def cancel(self) -> None:
        """Ask the engine to stop this job; ``result()`` then reports ``"cancelled"``."""
        if not self.done:
            self._client._send(Cancel(self.request_id))

    def _add_tokens(self, token_ids: list[int]) -> None:
        with self._changed:
            self._tokens.extend(token_ids)
            self._changed.notify_all()

    def _finish(self, message: Finished) -> None:
        with self._changed:
            self._result = Result(
                list(self._tokens), message.text, message.finish_reason, message.num_prompt_tokens
            )
            self._changed.notify_all()

    def _fail(self, error: Exception) -> None:
        with self._changed:
            if self._result is None and self._error is None:
                self._error = error
                self._changed.notify_all()


class Client:
    """A connection to one engine. Usable from many threads, and as a context manager."""

    def __init__(self, address: str, *, connect_timeout: float = 30.0) -> None:
        self.address = address
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        )
        self._socket.connect(address)
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._jobs: dict[int, Job] = {}
        self._jobs_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._failure: EngineError | None = None
        self._closing = False
        self._welcome: Welcome | None = None
        self._welcomed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cbpipe-client", daemon=True)
        self._thread.start()
        self._send(Hello())
        if not self._welcomed.wait(connect_timeout) or self._welcome is None:
            failure = self._failure
            self.close()
            raise failure or EngineError(
                f"no cbpipe engine answered at {address} within {connect_timeout:.0f} s"
            )

    # --- public API ---------------------------------------------------------------------

    @property
    def model(self) -> str:
        assert self._welcome is not None
        return self._welcome.model

    @property
    def max_model_len(self) -> int:
        assert self._welcome is not None
        return self._welcome.max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids in a prompt must lie in ``[0, vocab_size)``."""
        assert self._welcome is not None
        return self._welcome.vocab_size

    def submit(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
    ) -> Job:
        """Queue one job; invalid parameters raise ``RequestError`` here or from the job."""
        params = SamplingParams(
            max_new_tokens, temperature, top_p, top_k, seed, tuple(stop_token_ids), ignore_eos
        )
        try:
            params.validate()
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        job = Job(next(self._ids), self)
        frame = encode(Submit(job.request_id, _prompt_payload(prompt), params))
        if len(frame) > MAX_FRAME_BYTES:
            raise RequestError(
                f"request of {len(frame)} bytes exceeds the engine's frame "
                f"limit of {MAX_FRAME_BYTES} bytes"
            )
        with self._jobs_lock:
            self._check_usable()
            self._jobs[job.request_id] = job
        self._send_frame(frame)
        return job

    def generate(
        self, prompts: Sequence[str | Sequence[int]], *, timeout: float | None = None, **params
    ) -> list[Result]:
        """Submit every prompt at once and return their results in order."""
        jobs = [self.submit(prompt, **params) for prompt in prompts]
        return [job.result(timeout) for job in jobs]

    def close(self) -> None:
        if self._closing:
            return
        if self._failure is None:
            self._send(Goodbye())  # the engine cancels what is still running for us
        self._closing = True
        os.write(self._wake_write, b"x")
        self._thread.join(timeout=5)
        self._fail_all(EngineError("the client was closed"))
        self._monitor.close(linger=0)
        self._socket.close(linger=CLOSE_LINGER_MS)
        self._context.term()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- the I/O thread -----------------------------------------------------------------

    def _send(self, message: Message) -> None:
        self._send_frame(encode(message))

    def _send_frame(self, frame: bytes) -> None:
        self._outbox.put(frame)
        os.write(self._wake_write, b"x")

    def _check_usable(self) -> None:
        if self._closing:
            raise EngineError("the client is closed")
        if self._failure is not None:
            raise self._failure

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        while not self._closing:
            events = dict(poller.poll())
            if self._wake_read in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_read, 65536)
                self._send_queued()
            if self._monitor in events:
                self._on_monitor_event(zmq.utils.monitor.recv_monitor_message(self._monitor))
            if self._socket in events:
                while self._socket.poll(0):
                    self._on_frame(self._socket.recv())
        self._send_queued()  # the goodbye may have been queued after the last wake-up

    def _send_queued(self) -> None:
        while not self._outbox.empty():
            self._socket.send(self._outbox.get())

    def _on_monitor_event(self, event: Mapping[str, Any]) -> None:
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self._fail_all(EngineError(f"lost the connection to the engine at {self.address}"))

    def _on_frame(self, frame: bytes) -> None:
        try:
            message = decode(frame, expected=(Welcome, Tokens, Finished, Error))
        except ProtocolError as exc:
            log.warning("ignored a frame from the engine: %s", exc)
            return
        if isinstance(message, Welcome):
            self._welcome = message
            self._welcomed.set()
            return
        if isinstance(message, Tokens):
            with self._jobs_lock:
                jobs = [self._jobs.get(rid) for rid in message.request_ids]
            for job, token_ids in zip(jobs, message.token_ids, strict=True):
                if job is not None:
                    job._add_tokens(token_ids)
            return
        assert isinstance(message, (Finished, Error))
        with self._jobs_lock:
            job = self._jobs.get(message.request_id) if message.request_id is not None else None
            if job is not None:
                del self._jobs[message.request_id]  # type: ignore[arg-type]
        if job is None:
            if isinstance(message, Error):
                log.warning("engine error not tied to a job: %s", message.message)
            return
        if isinstance(message, Finished):
            job._finish(message)
        elif message.kind is ErrorKind.REQUEST:
            job._fail(RequestError(message.message))
        else:
            job._fail(EngineError(message.message))

    def _fail_all(self, error: EngineError) -> None:
        with self._jobs_lock:
            if self._failure is None and not self._closing:
                self._failure = error
            jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            job._fail(error)
        self._welcomed.set()


def _prompt_payload(prompt: object) -> str | list[int]:
    """A text prompt as is, or token ids as a list; anything else is a ``RequestError``."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        token_ids = list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            return token_ids
    raise RequestError("a prompt must be a string or a list of integer token ids")
