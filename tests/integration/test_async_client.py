"""``AsyncClient`` against a real engine: the same answers as ``Client``, concurrency on one
event loop, cancellation and the engine's counters."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import pytest

from cbpipe.client import AsyncClient, Client, RequestError
from tests.integration.conftest import VOCAB_SIZE, EngineRun
from tests.integration.helpers import RESULT_TIMEOUT_S, random_prompt


def run(engine: EngineRun, test: Callable[[AsyncClient], Awaitable[None]]) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(engine.address) as client:
            await asyncio.wait_for(test(client), 4 * RESULT_TIMEOUT_S)

    asyncio.run(main())


def test_same_tokens_as_the_threaded_client(engine: EngineRun, client: Client) -> None:
    rng = random.Random(11)
    prompts = [random_prompt(rng, rng.randrange(3, 40)) for _ in range(12)]
    options = [{}, {"temperature": 0.9, "top_p": 0.8, "top_k": 20, "seed": 5}]
    expected = [
        client.generate(prompts, max_new_tokens=12, timeout=RESULT_TIMEOUT_S, **o) for o in options
    ]

    async def test(aclient: AsyncClient) -> None:
        assert aclient.vocab_size == VOCAB_SIZE
        for o, want in zip(options, expected, strict=True):
            got = await aclient.generate(prompts, max_new_tokens=12, **o)
            assert [r.token_ids for r in got] == [r.token_ids for r in want]
            assert [r.finish_reason for r in got] == [r.finish_reason for r in want]

    run(engine, test)


def test_many_streams_on_one_loop(engine: EngineRun) -> None:
    async def test(client: AsyncClient) -> None:
        rng = random.Random(12)
        jobs = [
            client.submit(
                random_prompt(rng, 8), max_new_tokens=rng.randrange(1, 20), ignore_eos=True
            )  # fmt: skip
            for _ in range(40)
        ]

        async def streamed(job):  # type: ignore[no-untyped-def]
            return [token async for token in job.stream()]

        streams = await asyncio.gather(*(streamed(job) for job in jobs))
        for job, tokens in zip(jobs, streams, strict=True):
            result = await job.result()
            assert tokens == result.token_ids
            assert len(tokens) == job.params.max_new_tokens
            assert result.finish_reason == "length"

    run(engine, test)


def test_cancel_frees_the_blocks(engine: EngineRun) -> None:
    async def test(client: AsyncClient) -> None:
        rng = random.Random(13)
        jobs = [
            client.submit(random_prompt(rng, 30), max_new_tokens=1500, ignore_eos=True)
            for _ in range(3)
        ]
        for job in jobs:
            async for _ in job.stream():
                break
        assert (await client.stats()).num_running >= 1
        await asyncio.gather(*(job.cancel() for job in jobs))
        for job in jobs:
            result = await job.result()
            assert result.finish_reason == "cancelled"
            assert len(result.token_ids) < 1500
        stats = await client.stats()
        assert (stats.num_running, stats.num_waiting) == (0, 0)
        assert stats.kv_cache_usage == 0.0

    run(engine, test)


def test_a_refused_job_raises_and_others_go_on(engine: EngineRun) -> None:
    async def test(client: AsyncClient) -> None:
        bad = client.submit([VOCAB_SIZE + 5], max_new_tokens=4)
        good = client.submit([5, 6, 7], max_new_tokens=4, ignore_eos=True)
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await bad.result()
        assert len((await good.result()).token_ids) == 4

    run(engine, test)
