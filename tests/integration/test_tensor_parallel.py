"""Tensor parallelism through the real launcher, on the CPU (gloo, float32).

Greedy tokens at ``--tensor-parallel-size`` 2 and 4 are transformers' ``generate`` tokens, on
the embedded model and on a tiny Qwen2 checkpoint whose 8 heads and 4 kv heads split four
ways (the embedded model's 2 kv heads do not: that size is refused before any child
starts). Seeded sampling through the full sampler at size 2 gives size 1's tokens, in async
and sync mode: the ranks' carry-over and sampling state can only agree with size 1 if they
agree with each other. A killed rank fails every job with ``EngineError``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cbpipe.client import Client, EngineError
from cbpipe.models import EMBEDDED_MODEL_DIR
from tests.integration.conftest import EngineRun, launch_engine, leftover_segments
from tests.integration.helpers import RESULT_TIMEOUT_S
from tests.integration.test_engine_process import (
    JOB_FAILURE_S,
    assert_jobs_fail,
    submit_long_jobs,
    wait_launcher_exit,
)
from tests.integration.test_reliability import LIVENESS_S, stopped_child_test

START_TIMEOUT_S = 180.0  # several ranks import torch side by side on a small machine
MAX_NEW_TOKENS = 12
# Chunked prefill (prompts longer than a step's tokens) and blocks of 8: prompts cross both.
ENGINE_FLAGS = ("--device", "cpu", "--num-blocks", "128", "--block-size", "8",
                "--max-batch-tokens", "32", "--max-num-seqs", "8")  # fmt: skip
QWEN2_VOCAB = 256


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 9, 17, 40)]


def _generate(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens, with no stop token (the engines ignore EOS)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # EOS is a token like any other here
    outputs = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def _serve_greedy(run: EngineRun, prompts: list[list[int]]) -> list[list[int]]:
    with Client(run.address) as client:
        results = client.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return [r.token_ids for r in results]


def _sampled(run: EngineRun, prompts: list[list[int]]) -> list[list[int]]:
    """Seeded draws through the full sampler (top-k, top-p, a repetition penalty) and the
    temperature-only one, submitted together so they share steps."""
    with Client(run.address) as client:
        jobs = [
            client.submit(p, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, seed=i,
                          temperature=1.0, **({"top_k": 20, "top_p": 0.9} if i % 2 else {}))
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        jobs.append(
            client.submit(prompts[-1], max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, seed=7,
                          temperature=0.8, repetition_penalty=1.3)
        )  # fmt: skip
        return [job.result(timeout=RESULT_TIMEOUT_S).token_ids for job in jobs]


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (attention biases, GQA 2:1) with 8 heads and 4 kv heads: splits 2 and 4
    ways."""
    from tests.architectures import Arch, build_checkpoint

    arch = Arch(
        "qwen2",
        {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8, "vocab_size": 256},
    )
    return build_checkpoint(arch, tmp_path_factory.mktemp("tp") / "qwen2")


@pytest.fixture(scope="module")
def default_reference() -> Iterator[tuple[list[list[int]], list[list[int]]]]:
    """The embedded model at size 1: its greedy and seeded tokens."""
    prompts = _prompts(2048, seed=0)
    with launch_engine("--model", "default", *ENGINE_FLAGS, timeout=START_TIMEOUT_S) as run:
        yield _serve_greedy(run, prompts), _sampled(run, prompts)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_embedded_model_at_size_2_matches_generate_and_size_1(
    default_reference: tuple[list[list[int]], list[list[int]]], mode: str
) -> None:
    prompts = _prompts(2048, seed=0)
    greedy_1, sampled_1 = default_reference
    expected = _generate(EMBEDDED_MODEL_DIR, prompts)
    assert greedy_1 == expected  # the reference itself, else a failure below says nothing
    flags = ("--model", "default", *ENGINE_FLAGS, "--tensor-parallel-size", "2")
    flags += ("--sync",) if mode == "sync" else ()
    with launch_engine(*flags, timeout=START_TIMEOUT_S) as run:
        assert {"worker0", "worker1"} <= set(run.engine.ready_fields)
        assert _serve_greedy(run, prompts) == expected
        assert _sampled(run, prompts) == sampled_1


@pytest.mark.parametrize("size", [2, 4])
def test_qwen2_at_size_n_matches_generate(qwen2_folder: Path, size: int) -> None:
    prompts = _prompts(QWEN2_VOCAB, seed=1)
    expected = _generate(qwen2_folder, prompts)
    flags = ("--model", str(qwen2_folder), *ENGINE_FLAGS, "--tensor-parallel-size", str(size))
    with launch_engine(*flags, timeout=START_TIMEOUT_S) as run:
        assert len(set(run.child_pids())) == size + 1  # the ranks and the scheduler
        assert _serve_greedy(run, prompts) == expected


def test_a_size_the_kv_heads_do_not_divide_into_is_refused_before_any_child() -> None:
    """The embedded model has 2 kv heads: 4 ranks cannot split them."""
    result = subprocess.run(
        [sys.executable, "-m", "cbpipe.launcher", "--device", "cpu",
         "--tensor-parallel-size", "4"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "LlamaForCausalLM" in result.stderr
    assert "2 kv heads" in result.stderr and "4 ranks" in result.stderr, result.stderr


def test_a_killed_rank_fails_every_job_and_stops_the_launcher() -> None:
    flags = ("--model", "default", *ENGINE_FLAGS, "--tensor-parallel-size", "2")
    with launch_engine(*flags, timeout=START_TIMEOUT_S) as run:
        victim = int(run.engine.ready_fields["worker1"])
        with Client(run.address) as client:
            jobs = submit_long_jobs(client, 4)
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            assert_jobs_fail(jobs, JOB_FAILURE_S)
            with pytest.raises(EngineError):  # at submit or from the job, never a hang
                client.submit([5, 6, 7], max_new_tokens=4).result(timeout=JOB_FAILURE_S)
        code = wait_launcher_exit(run, since=killed_at)
        assert code != 0
        assert "worker1 exited unexpectedly" in run.stderr, run.stderr
        assert not leftover_segments(run.pid)
        run.assert_cleaned_up()  # rank 0 and the scheduler are gone too


def test_a_stopped_rank_fails_every_job_and_stops_the_launcher() -> None:
    """A rank that stops (SIGSTOP: alive, silent) holds the others in their next
    collective; its heartbeat goes stale, and the engine fails as for a stopped worker."""
    flags = ("--model", "default", *ENGINE_FLAGS, "--tensor-parallel-size", "2",
             "--liveness-timeout-s", str(LIVENESS_S))  # fmt: skip
    with launch_engine(*flags, timeout=START_TIMEOUT_S) as run:
        victim = int(run.engine.ready_fields["worker1"])
        stopped_child_test(run, victim, "worker1 stopped responding")
