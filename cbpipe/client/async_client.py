"""The asyncio client: ``AsyncClient`` and ``AsyncJob``, the same contract as ``Client``.

Everything runs on the event loop that connected the client: one task receives the engine's
replies and routes them (``route_reply``, shared with ``Client``) to their jobs' states,
another watches the connection and fails every unfinished job with ``EngineError`` when the
engine goes away (after routing the replies that came before). No threads, no locks: a
job's state changes only between two awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any, Unpack

import zmq
import zmq.asyncio
import zmq.utils.monitor

from cbpipe.client.client import CLOSE_LINGER_MS
from cbpipe.client.jobs import (
    MONITORED_EVENTS,
    Delta,
    EngineError,
    JobChange,
    JobState,
    PromptLogprob,
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


class AsyncJob:
    """One submitted generation of ``n`` samples. ``deltas()``, ``stream()`` and
    ``result()`` may be mixed and awaited by several tasks; a late reader still gets
    everything from the start."""

    def __init__(
        self,
        request_id: int,
        params: SamplingParams,
        client: AsyncClient,
        detokenizer: Detokenizer | None = None,
    ) -> None:
        self.request_id = request_id
        self._client = client
        self._state = JobState(request_id, params, detokenizer)
        self._changed = asyncio.Event()

    def __repr__(self) -> str:
        return f"AsyncJob(request_id={self.request_id})"

    @property
    def params(self) -> SamplingParams:
        return self._state.params

    @property
    def done(self) -> bool:
        return self._state.done

    @property
    def prompt_logprobs(self) -> PromptLogprob | None:
        """The prompt's log-probabilities, once they arrived (a job that asked for them gets
        them before its first tokens)."""
        return self._state.prompt_logprobs

    async def result(self, timeout: float | None = None) -> Result:
        """Wait for the job to finish; raises ``TimeoutError`` after ``timeout`` seconds.
        A job of several samples has ``results()`` instead."""
        self._state.require_one_sample("results()")
        return (await self.results(timeout))[0]

    async def results(self, timeout: float | None = None) -> list[Result]:
        """Every sample's result, by index, once all are finished."""
        try:
            async with asyncio.timeout(timeout):
                while not self._state.done:
                    await self._wait()
        except TimeoutError:
            raise TimeoutError(f"job {self.request_id} not finished after {timeout} s") from None
        return self._state.results()

    async def delta_batches(self, timeout: float | None = None) -> AsyncIterator[list[Delta]]:
        """Yield what arrived since the last batch, at once: one delta per step while the
        reader keeps up, several when it fell behind. ``timeout`` bounds each wait."""
        seen, state = 0, self._state
        while True:
            try:
                async with asyncio.timeout(timeout):
                    while state.num_deltas == seen and not state.done:
                        await self._wait()
            except TimeoutError:
                raise TimeoutError(f"job {self.request_id}: nothing new for {timeout} s") from None
            new = state.deltas(seen)
            seen += len(new)
            error, over = state.error, state.done
            if new:
                yield new
            if error is not None:
                raise error
            if over and seen == state.num_deltas:
                return

    async def deltas(self, timeout: float | None = None) -> AsyncIterator[Delta]:
        """Yield what each step added to each sample, as it arrives; ``timeout`` bounds each
        wait. Each sample's last delta has its ``finish_reason``."""
        async for batch in self.delta_batches(timeout):
            for delta in batch:
                yield delta

    def stream(self, timeout: float | None = None) -> AsyncIterator[int]:
        """Yield generated token ids as they arrive (a job of one sample: ``ValueError``
        for more, whose tokens would interleave; ``deltas()`` names each one's sample)."""
        self._state.require_one_sample("deltas()")
        return self._token_ids(timeout)

    async def _token_ids(self, timeout: float | None) -> AsyncIterator[int]:
        async for batch in self.delta_batches(timeout):
            for delta in batch:
                for token_id in delta.token_ids:
                    yield token_id

    async def cancel(self) -> None:
        """Ask the engine to stop this job; ``result()`` then reports ``"cancelled"``."""
        if not self.done:
            self._client._send(Cancel(self.request_id))

    def cancel_nowait(self) -> None:
        """``cancel()`` for code that cannot await (a cancelled task's clean-up); a client
        that is closed or lost has nothing left to cancel."""
        if not self.done and self._client.failure is None and not self._client._closing:
            self._client._send_nowait(encode(Cancel(self.request_id)))

    async def _wait(self) -> None:
        # Cleared before each wait: the state was checked since the last change (nothing
        # runs between the check and here), and a change sets the event for every waiter.
        self._changed.clear()
        await self._changed.wait()

    def _update(self, change: JobChange) -> bool:
        """Apply ``change`` and wake the readers; whether the job is now done."""
        change(self._state)
        self._changed.set()
        return self._state.done

    def _add_tokens(self, frame: Tokens, entry: int) -> None:
        stopped = self._state.on_tokens(frame, entry)
        self._changed.set()
        if stopped is not None and self._client.failure is None and not self._client._closing:
            self._client._send_nowait(encode(Cancel(self.request_id, stopped)))


class AsyncClient:
    """A connection to one engine, for asyncio. Connect with ``await
    AsyncClient.connect(address)`` or ``async with AsyncClient(address) as client``; use it
    from the event loop that connected it."""

    def __init__(
        self, address: str, *, api_key: str | None = None, tokenizer: Any | None = None
    ) -> None:
        """A client of the engine at ``address`` (connect it before use); ``api_key``
        (default ``$CBPIPE_API_KEY``) is needed for an engine that serves other machines.
        ``tokenizer`` (the model's, or the folder or Hub id to load it from): this client
        makes its jobs' text itself, and the engine sends token ids only (``Client``'s docs say
        why)."""
        self.address = address
        self._detokenizer = Detokenizer.of(tokenizer)
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        configure_client_socket(self._socket, address, api_key)
        self._monitor = self._socket.get_monitor_socket(MONITORED_EVENTS)
        self._socket.connect(address)
        self._jobs: dict[int, AsyncJob] = {}
        self._stats_waiters: deque[asyncio.Future[Stats]] = deque()
        self._ids = itertools.count(1)
        self._failure: EngineError | None = None
        self._closing = False
        self._welcome: Welcome | None = None
        self._welcomed: asyncio.Future[Welcome] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def connect(
        cls,
        address: str,
        *,
        connect_timeout: float = 30.0,
        api_key: str | None = None,
        tokenizer: Any | None = None,
    ) -> AsyncClient:
        """A client that the engine at ``address`` has welcomed; ``EngineError`` if no
        engine answers within ``connect_timeout`` seconds."""
        client = cls(address, api_key=api_key, tokenizer=tokenizer)
        await client._start(connect_timeout)
        return client

    async def __aenter__(self) -> AsyncClient:
        if self._welcome is None:
            await self._start(30.0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

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

    @property
    def has_tokenizer(self) -> bool:
        """Whether the engine can tokenize text prompts and detokenize outputs."""
        assert self._welcome is not None
        return self._welcome.has_tokenizer

    @property
    def failure(self) -> EngineError | None:
        """Why the engine can no longer be used (it went away), or None."""
        return self._failure

    def submit(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int,
        **options: Unpack[SamplingOptions],
    ) -> AsyncJob:
        """Queue one job (``Client.submit``'s arguments); invalid parameters raise
        ``RequestError`` here or from the job."""
        self._check_usable()
        request_id = next(self._ids)
        limit = self._welcome.max_frame_bytes if self._welcome is not None else MAX_FRAME_BYTES
        text_here = self._detokenizer is not None
        params, frame = submit_frame(
            request_id, prompt, max_new_tokens, options, limit, text_here=text_here
        )
        job = AsyncJob(request_id, params, self, self._detokenizer)
        self._jobs[request_id] = job
        self._send_nowait(frame)
        return job

    async def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        max_new_tokens: int,
        timeout: float | None = None,
        **options: Unpack[SamplingOptions],
    ) -> list[Result]:
        """Submit every prompt at once and return their results in order."""
        jobs = [self.submit(p, max_new_tokens=max_new_tokens, **options) for p in prompts]
        return [await job.result(timeout) for job in jobs]

    async def stats(self, timeout: float = 10.0) -> Stats:
        """The engine's counters: running and waiting requests, KV-cache use, tokens."""
        self._check_usable()
        waiter: asyncio.Future[Stats] = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(waiter)
        self._send(GetStats())
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            raise EngineError(f"the engine did not answer within {timeout:.0f} s") from None

    async def close(self, reason: str = "the client was closed") -> None:
        """Cancel this client's unfinished jobs on the engine and release the sockets; the
        jobs' readers get an ``EngineError`` saying ``reason``."""
        if self._closing:
            return
        if self._failure is None and self._welcome is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._send(Goodbye())  # the engine cancels what is still running for us
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all(EngineError(reason))
        self._socket.disable_monitor()  # before its reader goes: see scheduler.process._close
        self._monitor.close(linger=0)
        self._socket.close(linger=CLOSE_LINGER_MS)
        self._context.term()

    # --- the event loop's side ----------------------------------------------------------

    async def _start(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self._welcomed = loop.create_future()
        receiving = loop.create_task(self._receive(), name="cbpipe-client-receive")
        watching = loop.create_task(self._watch_connection(receiving), name="cbpipe-client-watch")
        self._tasks = [receiving, watching]
        self._send(Hello())
        try:
            await asyncio.wait_for(asyncio.shield(self._welcomed), timeout)
        except TimeoutError:
            await self.close()
            raise EngineError(
                f"no cbpipe engine answered at {self.address} within {timeout:.0f} s"
            ) from None
        except EngineError:
            await self.close()
            raise

    def _send(self, message: Message) -> None:
        self._check_usable()
        self._send_nowait(encode(message))

    def _send_nowait(self, frame: bytes) -> None:
        """Queue a frame without waiting for ZeroMQ to take it: a DEALER whose connection
        failed its handshake has no pipe, and an awaited send would wait past every timeout
        (the connection watcher says why the client failed)."""
        sent = asyncio.ensure_future(self._socket.send(frame))  # already a future: no task
        sent.add_done_callback(self._check_sent)

    def _check_sent(self, sent: asyncio.Future[Any]) -> None:
        if not sent.cancelled() and sent.exception() is not None:
            log.warning("a frame to the engine was not sent: %s", sent.exception())

    def _check_usable(self) -> None:
        if self._closing:
            raise EngineError("the client is closed")
        if self._failure is not None:
            raise self._failure

    async def _receive(self) -> None:
        while True:
            route_reply(await self._socket.recv(), self)

    async def _watch_connection(self, receiving: asyncio.Task[None]) -> None:
        while True:
            event = zmq.utils.monitor.parse_monitor_message(await self._monitor.recv_multipart())
            error = connection_error(event["event"], self.address, self._welcome is not None)
            if error is not None:
                break
        # The engine's last replies (errors that say why) arrived before its disconnect:
        # route them, in order, before failing what is left.
        receiving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await receiving
        while True:
            try:
                frame = await self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            route_reply(frame, self)
        self._fail_all(error)

    # --- ReplySink: what route_reply hands over -----------------------------------------

    def on_welcome(self, message: Welcome) -> None:
        self._welcome = message
        if self._welcomed is not None and not self._welcomed.done():
            self._welcomed.set_result(message)

    def on_stats(self, message: Stats) -> None:
        while self._stats_waiters:
            waiter = self._stats_waiters.popleft()
            if not waiter.done():  # one whose caller gave up takes no answer
                waiter.set_result(message)
                return

    def update_job(self, request_id: int, change: JobChange) -> bool:
        job = self._jobs.get(request_id)
        if job is None:
            return False
        if job._update(change):
            del self._jobs[request_id]
        return True

    def on_tokens(self, message: Tokens) -> None:
        jobs = self._jobs
        for entry, request_id in enumerate(message.request_ids):
            job = jobs.get(request_id)
            if job is not None:
                job._add_tokens(message, entry)

    def _fail_all(self, error: EngineError) -> None:
        if self._failure is None and not self._closing:
            self._failure = error
        jobs, self._jobs = list(self._jobs.values()), {}
        waiters, self._stats_waiters = list(self._stats_waiters), deque()
        for job in jobs:
            job._update(lambda state: state.on_error(error))
        for waiter in [*waiters, self._welcomed]:
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)
                waiter.exception()  # retrieved: a caller that gave up is not an error to log
