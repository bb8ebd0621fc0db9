"""``AsyncClient`` against a scripted engine: a ROUTER socket in the test's own event loop
that answers what the test tells it to, so every frame sequence (several samples, errors,
an engine that goes away) is cheap to produce. The real engine is in
``tests/integration/test_async_client.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from cbpipe.client import AsyncClient, EngineError, RequestError
from cbpipe.protocol.messages import (
    Cancel,
    Error,
    ErrorKind,
    Finished,
    GetStats,
    Goodbye,
    Hello,
    Message,
    Stats,
    Submit,
    Tokens,
    Welcome,
    decode,
    encode,
)

WAIT_S = 10.0  # generous bound on any wait: nothing here takes more than milliseconds


class FakeEngine:
    """A ROUTER socket that welcomes clients and records what they send."""

    def __init__(self, address: str) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.identity: bytes | None = None
        self.received: asyncio.Queue[Message] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, frame = await self.socket.recv_multipart()
            self.identity = identity
            message = decode(frame)
            if isinstance(message, Hello):
                await self.send(Welcome("fake", 100, 64, False))
                continue
            await self.received.put(message)

    async def send(self, message: Message) -> None:
        assert self.identity is not None
        await self.socket.send_multipart([self.identity, encode(message)])

    async def next(self, kind: type[Message]) -> Any:
        """The next message the client sent, which must be of type ``kind``."""
        message = await asyncio.wait_for(self.received.get(), WAIT_S)
        assert isinstance(message, kind), message
        return message

    async def close(self) -> None:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task
        self.socket.close(linger=0)
        self.context.term()


def run_with_engine(tmp_path: Path, test: Callable[[FakeEngine, str], Awaitable[None]]) -> None:
    async def main() -> None:
        address = f"ipc://{tmp_path}/engine.sock"
        engine = FakeEngine(address)
        try:
            await asyncio.wait_for(test(engine, address), 4 * WAIT_S)
        finally:
            await engine.close()

    asyncio.run(main())


def test_connect_reads_the_welcome(tmp_path: Path) -> None:
    async def test(engine: FakeEngine, address: str) -> None:
        async with AsyncClient(address) as client:
            assert (client.model, client.vocab_size, client.max_model_len) == ("fake", 100, 64)
            assert client.has_tokenizer is False
        await engine.next(Goodbye)

    run_with_engine(tmp_path, test)


def test_no_engine_is_an_engine_error(tmp_path: Path) -> None:
    async def main() -> None:
        with pytest.raises(EngineError, match="no cbpipe engine answered"):
            await AsyncClient.connect(f"ipc://{tmp_path}/nobody.sock", connect_timeout=0.2)

    asyncio.run(main())


def test_deltas_stream_and_results_of_several_samples(tmp_path: Path) -> None:
    async def test(engine: FakeEngine, address: str) -> None:
        client = await AsyncClient.connect(address)
        job = client.submit([1, 2, 3], max_new_tokens=4, n=2, logprobs=1, temperature=1.0)
        submit = await engine.next(Submit)
        assert (submit.request_id, submit.prompt, submit.params.n) == (job.request_id, [1, 2, 3], 2)
        rid = job.request_id
        early = asyncio.ensure_future(job.results())  # a reader waiting before anything came
        await engine.send(
            Tokens(
                [rid, rid],
                [[5], [6]],
                indices=[0, 1],
                logprobs=[[-0.5], [-1.0]],
                top_ids=[[[5]], [[7]]],
                top_logprobs=[[[-0.5]], [[-0.25]]],
            )  # fmt: skip
        )
        await engine.send(Tokens([rid], [[8]], indices=[1], logprobs=[[-2.0]],
                                 top_ids=[[[8]]], top_logprobs=[[[-2.0]]]))  # fmt: skip
        await engine.send(Finished(rid, "length", None, 3, index=1))
        await engine.send(Finished(rid, "stop", None, 3, index=0, stop_reason=2))
        results = await early
        assert [r.token_ids for r in results] == [[5], [6, 8]]
        assert [r.finish_reason for r in results] == ["stop", "length"]
        assert results[0].stop_reason == 2 and results[1].logprobs == [-1.0, -2.0]
        assert results[1].top_logprobs == [[(7, -0.25)], [(8, -2.0)]]
        # A late reader gets everything from the start, each sample ending with its reason.
        deltas = [d async for d in job.deltas()]
        assert [(d.index, d.token_ids, d.finish_reason) for d in deltas] == [
            (0, [5], None), (1, [6], None), (1, [8], None), (1, [], "length"), (0, [], "stop")
        ]  # fmt: skip
        with pytest.raises(ValueError, match="results"):
            await job.result()
        with pytest.raises(ValueError, match="deltas"):  # the samples' tokens would interleave
            job.stream()
        await client.close()

    run_with_engine(tmp_path, test)


def test_one_frame_moves_several_jobs_and_skips_a_finished_one(tmp_path: Path) -> None:
    async def test(engine: FakeEngine, address: str) -> None:
        client = await AsyncClient.connect(address)
        first, second, done = (client.submit([1], max_new_tokens=3) for _ in range(3))
        for _ in range(3):
            await engine.next(Submit)
        await engine.send(Finished(done.request_id, "stop", None, 1))
        assert (await done.result()).finish_reason == "stop"
        waiting = asyncio.ensure_future(anext(second.stream()))  # woken by the shared frame
        # One step's frame: a finished job's entry among them (a cancel that crossed it)
        # is dropped, and each live job gets its own entry.
        await engine.send(
            Tokens([first.request_id, done.request_id, second.request_id], [[4], [9], [5, 6]])
        )
        assert await asyncio.wait_for(waiting, WAIT_S) == 5
        for job in (first, second):
            await engine.send(Finished(job.request_id, "length", None, 1))
        assert (await first.result()).token_ids == [4]
        assert (await second.result()).token_ids == [5, 6]
        assert (await done.result()).token_ids == []
        await client.close()

    run_with_engine(tmp_path, test)


def test_readers_in_several_tasks_see_the_same_stream(tmp_path: Path) -> None:
    async def test(engine: FakeEngine, address: str) -> None:
        async with AsyncClient(address) as client:
            job = client.submit([1], max_new_tokens=3)
            readers = [asyncio.ensure_future(_collect(job.stream())) for _ in range(3)]
            await engine.next(Submit)
            for token in (4, 5, 6):
                await engine.send(Tokens([job.request_id], [[token]]))
                await asyncio.sleep(0)
            await engine.send(Finished(job.request_id, "length", None, 1))
            assert await asyncio.gather(*readers) == [[4, 5, 6]] * 3
            assert (await job.result()).token_ids == [4, 5, 6]

    run_with_engine(tmp_path, test)


def test_cancel_sends_cancel_and_a_finished_job_sends_nothing(tmp_path: Path) -> None:
    async def test(engine: FakeEngine, address: str) -> None:
        async with AsyncClient(address) as client:
            job = client.submit([1], max_new_tokens=3)
            await engine.next(Submit)
            await job.cancel()
            assert (await engine.next(Cancel)).request_id == job.request_id
            await engine.send(Finished(job.request_id, "cancelled", None, 1))
            assert (await job.result()).finish_reason == "cancelled"
            await job.cancel()
            stats = asyncio.ensure_future(client.stats())
            await engine.next(GetStats)  # not a Cancel: the finished job sent nothing
            await engine.send(Stats(1, 2, 0.5, 10, 20, 0, 7))
            assert (await stats).num_waiting == 2

    run_with_engine(tmp_path, test)


def test_request_errors_from_submit_and_from_the_engine(tmp_path: Path) -> None:
    async def test(engine: FakeEngine, address: str) -> None:
        async with AsyncClient(address) as client:
            with pytest.raises(RequestError, match="temperature"):
                client.submit([1], max_new_tokens=3, temperature=-1.0)
            with pytest.raises(RequestError, match="prompt"):
                client.submit([1.5], max_new_tokens=3)  # type: ignore[list-item]
            job = client.submit([1], max_new_tokens=3)
            await engine.next(Submit)
            await engine.send(Error(job.request_id, ErrorKind.REQUEST, "prompt is too long"))
            with pytest.raises(RequestError, match="too long"):
                await job.result()
            with pytest.raises(RequestError, match="too long"):
                [d async for d in job.deltas()]
            other = client.submit([1], max_new_tokens=3)  # the client still serves
            await engine.next(Submit)
            await engine.send(Finished(other.request_id, "length", None, 1))
            assert (await other.result()).finish_reason == "length"

    run_with_engine(tmp_path, test)


def test_timeouts(tmp_path: Path) -> None:
    async def test(engine: FakeEngine, address: str) -> None:
        async with AsyncClient(address) as client:
            job = client.submit([1], max_new_tokens=3)
            with pytest.raises(TimeoutError):
                await job.result(timeout=0.05)
            with pytest.raises(TimeoutError):
                await _collect(job.stream(timeout=0.05))
            await engine.next(Submit)
            stats = asyncio.ensure_future(client.stats(timeout=0.05))
            await engine.next(GetStats)
            with pytest.raises(EngineError, match="did not answer"):
                await stats

    run_with_engine(tmp_path, test)


def test_an_engine_that_goes_away_fails_every_job(tmp_path: Path) -> None:
    async def main() -> None:
        address = f"ipc://{tmp_path}/engine.sock"
        engine = FakeEngine(address)
        client = await AsyncClient.connect(address)
        job = client.submit([1], max_new_tokens=3)
        reader = asyncio.ensure_future(_collect(job.stream()))
        await engine.next(Submit)
        await engine.send(Tokens([job.request_id], [[4]]))
        await engine.close()
        with pytest.raises(EngineError, match="lost the connection"):
            await asyncio.wait_for(job.result(), WAIT_S)
        with pytest.raises(EngineError, match="lost the connection"):
            await asyncio.wait_for(reader, WAIT_S)
        with pytest.raises(EngineError):
            client.submit([1], max_new_tokens=3)
        with pytest.raises(EngineError):
            await client.stats()
        assert client.failure is not None
        await client.close()
        with pytest.raises(EngineError, match="closed"):
            client.submit([1], max_new_tokens=3)

    asyncio.run(main())


def test_an_engines_last_words_come_before_its_disconnect(tmp_path: Path) -> None:
    async def main() -> None:
        address = f"ipc://{tmp_path}/engine.sock"
        engine = FakeEngine(address)
        client = await AsyncClient.connect(address)
        told, untold = client.submit([1], max_new_tokens=3), client.submit([2], max_new_tokens=3)
        await engine.next(Submit)
        await engine.next(Submit)
        await engine.send(Error(told.request_id, ErrorKind.ENGINE, "the worker stopped"))
        await engine.close()
        with pytest.raises(EngineError, match="the worker stopped"):
            await asyncio.wait_for(told.result(), WAIT_S)
        with pytest.raises(EngineError, match="lost the connection"):
            await asyncio.wait_for(untold.result(), WAIT_S)
        await client.close()

    asyncio.run(main())


def test_close_fails_unfinished_jobs_and_says_goodbye(tmp_path: Path) -> None:
    async def test(engine: FakeEngine, address: str) -> None:
        client = await AsyncClient.connect(address)
        job = client.submit([1], max_new_tokens=3)
        await engine.next(Submit)
        await client.close()
        await engine.next(Goodbye)
        with pytest.raises(EngineError, match="closed"):
            await job.result()
        await client.close()  # twice is harmless

    run_with_engine(tmp_path, test)


async def _collect(tokens: Any) -> list[int]:
    return [token async for token in tokens]
