"""What jobs produce: the same tokens in sync and async mode, alone or batched, after a
preemption, and exactly up to a stop token."""

from __future__ import annotations

import random
from typing import Any

from cbpipe.client import Client, Result
from tests.integration.conftest import EngineRun
from tests.integration.helpers import RESULT_TIMEOUT_S, assert_full_length, random_prompt

SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 1234}


def make_requests() -> list[tuple[list[int], dict[str, Any]]]:
    """10 greedy and 10 seeded-sampled requests (a quarter may stop at EOS), within 256 tokens."""
    rng = random.Random(5)
    requests = []
    for i in range(20):
        params: dict[str, Any] = {"max_new_tokens": rng.randint(1, 64), "ignore_eos": i % 4 != 0}
        if i % 2:
            params |= SAMPLED
        requests.append((random_prompt(rng, rng.randint(1, 40)), params))
    return requests


def run_all(address: str, requests: list[tuple[list[int], dict[str, Any]]]) -> list[Result]:
    """Submit every request at once, so that they share steps, and collect them in order."""
    with Client(address) as client:
        jobs = [client.submit(prompt, **params) for prompt, params in requests]
        return [job.result(timeout=RESULT_TIMEOUT_S) for job in jobs]


def test_sync_and_async_modes_give_identical_tokens(
    engine: EngineRun, sync_engine: EngineRun
) -> None:
    requests = make_requests()
    from_async = run_all(engine.address, requests)
    from_sync = run_all(sync_engine.address, requests)

    for (_, params), a, s in zip(requests, from_async, from_sync, strict=True):
        assert a.finish_reason in ("length", "stop")
        assert (s.token_ids, s.finish_reason) == (a.token_ids, a.finish_reason), params
        assert len(a.token_ids) <= params["max_new_tokens"]
        if params["ignore_eos"]:
            assert len(a.token_ids) == params["max_new_tokens"]


def test_one_at_a_time_matches_batched(engine: EngineRun) -> None:
    """Each request alone gives what it gave sharing steps with the others."""
    requests = make_requests()[:6]
    batched = run_all(engine.address, requests)
    alone = [run_all(engine.address, [request])[0] for request in requests]
    assert [r.token_ids for r in alone] == [r.token_ids for r in batched]


def test_stop_token_ends_the_job_exactly_there(client: Client) -> None:
    prompt = random_prompt(random.Random(8), 9)  # its greedy output varies for a while
    tokens = client.submit(prompt, max_new_tokens=40, ignore_eos=True).result(RESULT_TIMEOUT_S)
    # Stop at the first token not seen before it, so that nothing earlier stops the job.
    k = next(i for i in range(5, 40) if tokens.token_ids[i] not in tokens.token_ids[:i])
    stop_id = tokens.token_ids[k]

    result = client.submit(
        prompt, max_new_tokens=40, ignore_eos=True, stop_token_ids=[stop_id]
    ).result(RESULT_TIMEOUT_S)
    assert result.finish_reason == "stop"
    # Whether the stop token is part of the output is a convention; nothing after it is.
    assert result.token_ids in (tokens.token_ids[:k], tokens.token_ids[: k + 1])


def test_results_survive_preemption(client: Client) -> None:
    """6 jobs of 1300 + 200 tokens need 9000 KV slots and the engine has 512 * 16 = 8192: all
    of them start (their prompts fit), so some are preempted and recomputed on the way."""
    rng = random.Random(7)
    prompts = [random_prompt(rng, 1300) for _ in range(6)]
    params = {"max_new_tokens": 200, "ignore_eos": True}
    squeezed = client.generate(prompts, timeout=RESULT_TIMEOUT_S, **params)
    roomy = [
        result
        for pair in (prompts[0:2], prompts[2:4], prompts[4:6])
        for result in client.generate(pair, timeout=RESULT_TIMEOUT_S, **params)
    ]
    for result in squeezed:
        assert_full_length(result, 200)
    assert [r.token_ids for r in squeezed] == [r.token_ids for r in roomy]


def test_a_result_says_how_much_of_its_prompt_the_cache_served(client: Client) -> None:
    prompt = random_prompt(random.Random(6), 40)  # two full blocks of 16 to reuse
    first = client.submit(prompt, max_new_tokens=2).result(timeout=RESULT_TIMEOUT_S)
    again = client.submit(prompt, max_new_tokens=2).result(timeout=RESULT_TIMEOUT_S)
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert again.token_ids == first.token_ids
