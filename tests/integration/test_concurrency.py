"""Many clients and many jobs at once against the shared engine."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cbpipe.client import Client, Result
from tests.integration.conftest import EngineRun
from tests.integration.helpers import RESULT_TIMEOUT_S, assert_full_length, random_prompt

NUM_CLIENTS = 4
JOBS_PER_CLIENT = 50


@dataclass(frozen=True)
class Case:
    prompt: list[int]
    max_new_tokens: int
    sampled: bool  # seeded sampling, else greedy

    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "ignore_eos": True}
        if self.sampled:
            params |= {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 1234}
        return params


def make_cases(count: int) -> list[Case]:
    """Prompts of 1 to 200 tokens; every third one repeats an earlier prompt, shorter."""
    rng = random.Random(0)
    cases: list[Case] = []
    for i in range(count):
        if i % 3 == 2:
            earlier = cases[i - 2]
            cases.append(Case(earlier.prompt, earlier.max_new_tokens // 2 + 1, earlier.sampled))
        else:
            length = rng.choice([1, 2, 7, 16, 17, 33, 64, 120, 200])
            cases.append(Case(random_prompt(rng, length), rng.randint(1, 48), i % 2 == 1))
    return cases


def run_client(
    address: str, cases: list[Case], order_seed: int, start: threading.Barrier
) -> list[Result]:
    """Submit every case at once, in an order of this client's own; results in case order."""
    order = list(range(len(cases)))
    random.Random(order_seed).shuffle(order)
    with Client(address, connect_timeout=30) as client:
        start.wait(RESULT_TIMEOUT_S)
        jobs = {i: client.submit(cases[i].prompt, **cases[i].params()) for i in order}
        return [jobs[i].result(timeout=RESULT_TIMEOUT_S) for i in range(len(cases))]


def test_concurrent_clients_get_correct_and_identical_results(engine: EngineRun) -> None:
    cases = make_cases(JOBS_PER_CLIENT)
    start = threading.Barrier(NUM_CLIENTS)
    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        futures = [
            pool.submit(run_client, engine.address, cases, seed, start)
            for seed in range(NUM_CLIENTS)
        ]
        per_client = [future.result(timeout=2 * RESULT_TIMEOUT_S) for future in futures]

    for results in per_client:
        for case, result in zip(cases, results, strict=True):
            assert_full_length(result, case.max_new_tokens)
            assert result.num_prompt_tokens == len(case.prompt)
    # Greedy and seeded jobs do not depend on what else shares their batches.
    first, *others = per_client
    for results in others:
        assert [r.token_ids for r in results] == [r.token_ids for r in first]
    # A shorter job on the same prompt and parameters is a prefix of the longer one.
    for i in range(2, len(cases), 3):
        shorter, longer = first[i].token_ids, first[i - 2].token_ids
        assert longer[: len(shorter)] == shorter


def test_a_thousand_small_jobs_at_once(client: Client) -> None:
    prompts = [[3 + i % 250] * (1 + i % 5) for i in range(1000)]  # each one 4 times
    results = client.generate(prompts, max_new_tokens=3, ignore_eos=True, timeout=RESULT_TIMEOUT_S)

    assert len(results) == len(prompts)
    for prompt, result in zip(prompts, results, strict=True):
        assert_full_length(result, 3)
        assert result.num_prompt_tokens == len(prompt)  # results come back in order
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for prompt, result in zip(prompts, results, strict=True):
        assert by_prompt.setdefault(tuple(prompt), result.token_ids) == result.token_ids
