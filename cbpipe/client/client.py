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
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Unpack

import zmq
import zmq.utils.monitor

from cbpipe.client.jobs import (
    MONITORED_EVENTS,
    Delta,
    EngineError,
    JobChange,
    JobState,
    Result,
    SamplingOptions,
    configure_client_socket,
    connection_error,
    route_reply,
    submit_frame,
)
from cbpipe.detokenizer import Detokenizer
from cbpipe.protocol.messages import (
    MAX_FRAME_BYTES,
    Cancel,
    GetStats,
    Goodbye,
    Hello,
    Message,
    Stats,
    Tokens,
    Welcome,
    encode,
)
from cbpipe.protocol.sampling import SamplingParams

log = logging.getLogger("cbpipe.client")

CLOSE_LINGER_MS = 200  # time to deliver the goodbye to an engine that is still there


class Job:
    """One submitted generation of ``n`` samples. Thread-safe; ``stream()``, ``deltas()`` and
    ``result()`` may be mixed, and a late reader still gets everything from the start."""

    def __init__(
        self,
        request_id: int,
        params: SamplingParams,
        client: Client,
        detokenizer: Detokenizer | None = None,
    ) -> None:
        self.request_id = request_id
        self._client = client
        self._state = JobState(request_id, params, detokenizer)
        self._changed = threading.Condition()

    def __repr__(self) -> str:
        return f"Job(request_id={self.request_id})"

    @property
    def done(self) -> bool:
        with self._changed:
            return self._state.done

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the job to finish; raises ``TimeoutError`` after ``timeout`` seconds.
        A job of several samples has ``results()`` instead."""
        self._state.require_one_sample("results()")
        return self.results(timeout)[0]

    def results(self, timeout: float | None = None) -> list[Result]:
        """Every sample's result, by index, once all are finished."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._state.done, timeout):
                raise TimeoutError(f"job {self.request_id} not finished after {timeout} s")
            return self._state.results()

    def deltas(self, timeout: float | None = None) -> Iterator[Delta]:
        """Yield what each step added to each sample, as it arrives; ``timeout`` bounds each
        wait. Each sample's last delta has its ``finish_reason``."""
        seen, state = 0, self._state
        while True:
            with self._changed:
                ready = self._changed.wait_for(state.has_news_after(seen), timeout)
                if not ready:
                    raise TimeoutError(f"job {self.request_id}: nothing new for {timeout} s")
                new = state.deltas(seen)
                seen += len(new)
                error, over = state.error, state.done
            yield from new
            if error is not None:
                raise error
            if over and seen == state.num_deltas:
                return

    def stream(self, timeout: float | None = None) -> Iterator[int]:
        """Yield generated token ids as they arrive (a job of one sample: ``ValueError``
        for more, whose tokens would interleave; ``deltas()`` names each one's sample)."""
        self._state.require_one_sample("deltas()")
        return (token_id for delta in self.deltas(timeout) for token_id in delta.token_ids)

    def cancel(self) -> None:
        """Ask the engine to stop this job; ``result()`` then reports ``"cancelled"``."""
        if not self.done:
            self._client._send(Cancel(self.request_id))

    def _update(self, change: JobChange) -> bool:
        """Apply ``change`` and wake the readers; whether the job is now done."""
        with self._changed:
            change(self._state)
            self._changed.notify_all()
            return self._state.done

    def _add_tokens(self, frame: Tokens, entry: int) -> None:
        with self._changed:
            stopped = self._state.on_tokens(frame, entry)
            self._changed.notify_all()
        if stopped is not None:
            self._client._send(Cancel(self.request_id, stopped))


class Client:
    """A connection to one engine. Usable from many threads, and as a context manager."""

    def __init__(
        self,
        address: str,
        *,
        connect_timeout: float = 30.0,
        api_key: str | None = None,
        tokenizer: Any | None = None,
    ) -> None:
        """Connect to the engine at ``address``; ``api_key`` (default ``$CBPIPE_API_KEY``)
        is needed for an engine that serves other machines (``--allow-remote``).

        ``tokenizer`` (the model's, or the folder or Hub id ``AutoTokenizer`` loads it from):
        this client makes its jobs' text itself (decoding, stop strings) and the engine sends
        token ids only. The text is the same either way; what moves is the work, off the
        engine's scheduling thread, which at hundreds of streams of a small model spends
        about as much on text as on the rest of a step. A sample whose stop string this
        client finds is cancelled on the engine, which may have made a token or two more by
        then: they are dropped."""
        self.address = address
        self._detokenizer = Detokenizer.of(tokenizer)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        configure_client_socket(self._socket, address, api_key)
        self._monitor = self._socket.get_monitor_socket(MONITORED_EVENTS)
        self._socket.connect(address)
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._unsent: deque[bytes] = deque()  # taken from the outbox, not yet accepted by ZeroMQ
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._jobs: dict[int, Job] = {}
        self._stats_waiters: deque[queue.SimpleQueue[Stats | EngineError]] = deque()
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
        **options: Unpack[SamplingOptions],
    ) -> Job:
        """Queue one job; invalid parameters raise ``RequestError`` here or from the job.

        ``options`` are ``SamplingParams``' fields (``temperature``, ``top_p``, ``stop``,
        ``logprobs``, ``n``, ...); ``logit_bias`` maps token ids to biases."""
        request_id = next(self._ids)
        limit = self._welcome.max_frame_bytes if self._welcome is not None else MAX_FRAME_BYTES
        text_here = self._detokenizer is not None
        params, frame = submit_frame(
            request_id, prompt, max_new_tokens, options, limit, text_here=text_here
        )
        job = Job(request_id, params, self, self._detokenizer)
        with self._jobs_lock:
            self._check_usable()
            self._jobs[job.request_id] = job
        self._send_frame(frame)
        return job

    def stats(self, timeout: float = 10.0) -> Stats:
        """The engine's counters: running and waiting requests, KV-cache use, tokens."""
        waiter: queue.SimpleQueue[Stats | EngineError] = queue.SimpleQueue()
        with self._jobs_lock:
            self._check_usable()
            self._stats_waiters.append(waiter)
        self._send(GetStats())
        try:
            answer = waiter.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"the engine did not answer within {timeout:.0f} s") from None
        if isinstance(answer, EngineError):
            raise answer
        return answer

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        max_new_tokens: int,
        timeout: float | None = None,
        **options: Unpack[SamplingOptions],
    ) -> list[Result]:
        """Submit every prompt at once and return their results in order."""
        jobs = [self.submit(p, max_new_tokens=max_new_tokens, **options) for p in prompts]
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
        self._socket.disable_monitor()  # before its reader goes: see scheduler.process._close
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
        """The I/O thread. Should it fail, every job fails with it rather than wait forever."""
        try:
            self._serve()
        except Exception as exc:
            log.exception("the client's I/O thread failed")
            self._fail_all(EngineError(f"the client's I/O thread failed: {exc}"))

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        while not self._closing:
            poller.modify(self._socket, zmq.POLLIN | (zmq.POLLOUT if self._unsent else 0))
            events = dict(poller.poll())
            if self._wake_read in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_read, 65536)
            self._send_queued()
            # Frames first: an engine's last error replies arrive before its disconnect, and
            # say more than "lost the connection".
            if self._socket in events:
                while self._socket.poll(0):
                    route_reply(self._socket.recv(), self)
            if self._monitor in events:
                self._on_monitor_event(zmq.utils.monitor.recv_monitor_message(self._monitor))
        self._send_queued()  # the goodbye may have been queued after the last wake-up

    def _send_queued(self) -> None:
        """Hand queued frames to ZeroMQ without ever blocking: a DEALER whose connection failed
        its handshake has no pipe to queue into, and a blocked send would keep this thread from
        the monitor event that says why."""
        while not self._outbox.empty():
            self._unsent.append(self._outbox.get())
        while self._unsent:
            try:
                self._socket.send(self._unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._unsent.popleft()

    def _on_monitor_event(self, event: Mapping[str, Any]) -> None:
        error = connection_error(event["event"], self.address, self._welcome is not None)
        if error is not None:
            self._fail_all(error)

    # --- ReplySink: what route_reply hands over, on the I/O thread --------------------------

    def on_welcome(self, message: Welcome) -> None:
        self._welcome = message
        self._welcomed.set()

    def on_stats(self, message: Stats) -> None:
        with self._jobs_lock:
            waiter = self._stats_waiters.popleft() if self._stats_waiters else None
        if waiter is not None:
            waiter.put(message)

    def update_job(self, request_id: int, change: JobChange) -> bool:
        with self._jobs_lock:
            job = self._jobs.get(request_id)
        if job is None:
            return False
        if job._update(change):
            with self._jobs_lock:
                self._jobs.pop(request_id, None)
        return True

    def on_tokens(self, message: Tokens) -> None:
        with self._jobs_lock:
            jobs = [self._jobs.get(request_id) for request_id in message.request_ids]
        for entry, job in enumerate(jobs):
            if job is not None:
                job._add_tokens(message, entry)

    def _fail_all(self, error: EngineError) -> None:
        with self._jobs_lock:
            if self._failure is None and not self._closing:
                self._failure = error
            jobs, self._jobs = list(self._jobs.values()), {}
            waiters, self._stats_waiters = list(self._stats_waiters), deque()
        for job in jobs:
            job._update(lambda state: state.on_error(error))
        for waiter in waiters:
            waiter.put(error)
        self._welcomed.set()
