"""Streaming and cancellation against the shared engine."""

from __future__ import annotations

import random
import threading

import pytest

from cbpipe.client import Client, RequestError
from tests.integration.helpers import (
    RESULT_TIMEOUT_S,
    assert_client_serves,
    assert_full_length,
    first_tokens,
    random_prompt,
)

LONG = 2000  # decoding this many tokens takes seconds, far longer than a cancel's round trip


def test_stream_yields_tokens_before_the_job_is_done(client: Client) -> None:
    job = client.submit(random_prompt(random.Random(1), 12), max_new_tokens=300, ignore_eos=True)
    streamed: list[int] = []
    done_at_first_token = None
    for token in job.stream(timeout=RESULT_TIMEOUT_S):
        if not streamed:
            done_at_first_token = job.done
        streamed.append(token)

    assert done_at_first_token is False, "the first token came only with the end of the job"
    result = job.result(timeout=RESULT_TIMEOUT_S)
    assert_full_length(result, 300)
    assert streamed == result.token_ids
    assert result.text is None  # random:qwen2-tiny has no tokenizer
    assert result.num_prompt_tokens == 12


def test_stream_after_the_end_and_from_two_threads(client: Client) -> None:
    job = client.submit([7, 8, 9], max_new_tokens=40, ignore_eos=True)
    from_threads: list[list[int]] = [[], []]
    threads = [
        threading.Thread(target=lambda out=out: out.extend(job.stream(timeout=RESULT_TIMEOUT_S)))
        for out in from_threads
    ]
    for thread in threads:
        thread.start()
    result = job.result(timeout=RESULT_TIMEOUT_S)
    for thread in threads:
        thread.join(RESULT_TIMEOUT_S)

    assert_full_length(result, 40)
    assert from_threads == [result.token_ids, result.token_ids]
    assert list(job.stream(timeout=1)) == result.token_ids  # a late reader gets everything


def test_stream_of_a_refused_job_raises(client: Client) -> None:
    job = client.submit([], max_new_tokens=4)
    with pytest.raises(RequestError, match="empty"):
        list(job.stream(timeout=RESULT_TIMEOUT_S))


def test_cancel_a_running_job_leaves_the_others_alone(client: Client) -> None:
    rng = random.Random(2)
    others = [
        (client.submit(random_prompt(rng, n), max_new_tokens=m, ignore_eos=True), m)
        for n, m in [(3, 60), (20, 30), (50, 90), (1, 120)]
    ]
    victim = client.submit(random_prompt(rng, 10), max_new_tokens=LONG, ignore_eos=True)
    seen = first_tokens(victim, 5)
    victim.cancel()

    result = victim.result(timeout=RESULT_TIMEOUT_S)
    assert result.finish_reason == "cancelled"
    assert 5 <= len(result.token_ids) < LONG
    assert result.token_ids[:5] == seen
    assert list(victim.stream(timeout=1)) == result.token_ids
    for job, max_new_tokens in others:
        assert_full_length(job.result(timeout=RESULT_TIMEOUT_S), max_new_tokens)


def test_cancel_right_after_submit(client: Client) -> None:
    jobs = [client.submit([9] * (i + 1), max_new_tokens=LONG, ignore_eos=True) for i in range(8)]
    for job in jobs:
        job.cancel()
    for job in jobs:
        result = job.result(timeout=RESULT_TIMEOUT_S)
        assert result.finish_reason == "cancelled"
        assert len(result.token_ids) < LONG


def test_cancelled_jobs_give_their_kv_blocks_back(client: Client) -> None:
    # 5 jobs of 1500 + 130 tokens fit in the engine's 512 blocks of 16 tokens (102 each); if
    # cancelling leaked their blocks, a job needing 125 blocks could never start.
    rng = random.Random(3)
    jobs = [
        client.submit(random_prompt(rng, 1500), max_new_tokens=130, ignore_eos=True)
        for _ in range(5)
    ]
    for job in jobs:
        first_tokens(job, 1)
    for job in jobs:
        job.cancel()
    for job in jobs:
        assert job.result(timeout=RESULT_TIMEOUT_S).finish_reason == "cancelled"

    big = client.submit(random_prompt(rng, 1900), max_new_tokens=100, ignore_eos=True)
    assert_full_length(big.result(timeout=RESULT_TIMEOUT_S), 100)


def test_cancel_after_the_end_changes_nothing(client: Client) -> None:
    job = client.submit([4, 5], max_new_tokens=6, ignore_eos=True)
    result = job.result(timeout=RESULT_TIMEOUT_S)
    job.cancel()
    job.cancel()
    assert job.result(timeout=1) == result
    assert_full_length(result, 6)
    assert_client_serves(client)
