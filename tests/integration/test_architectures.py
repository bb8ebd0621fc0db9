"""Checkpoint folders of other architectures through the real launcher: a model with sliding
windows served exactly, and models cbpipe cannot serve refused before any child starts."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from cbpipe.client import Client
from tests.architectures import REFUSED, SERVED, WINDOW, build_checkpoint
from tests.harness import reference_greedy
from tests.integration.conftest import launch_engine
from tests.integration.helpers import RESULT_TIMEOUT_S

VOCAB = 256  # of the tiny checkpoints
MAX_NEW_TOKENS = 10


def _arch(name: str, archs: list) -> object:  # type: ignore[type-arg]
    return next(a for a in archs if a.name == name)


def test_gemma2_with_sliding_windows_matches_generate(tmp_path: Path) -> None:
    """Gemma 2: sliding and global layers, soft-capped scores, query_pre_attn_scalar; prompts
    and outputs cross the window of 12 tokens and the blocks of 8, in chunks of 24."""
    folder = build_checkpoint(_arch("gemma2", SERVED), tmp_path / "gemma2")  # type: ignore[arg-type]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, WINDOW + 1, 30, 50)]
    # transformers' generate with eager attention: SDPA drops the soft-cap.
    expected = [reference_greedy(str(folder), p, MAX_NEW_TOKENS, None) for p in prompts]
    flags = ("--model", str(folder), "--device", "cpu", "--num-blocks", "64", "--block-size", "8",
             "--max-batch-tokens", "24", "--max-num-seqs", "4")  # fmt: skip
    with launch_engine(*flags, timeout=120) as run, Client(run.address) as client:
        jobs = [client.submit(p, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True) for p in prompts]
        results = [job.result(RESULT_TIMEOUT_S) for job in jobs]
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize(
    ("name", "reason"),
    [("bloom", "its layers compute attention themselves"), ("falcon", "Falcon's own table")],
)
def test_the_launcher_refuses_a_model_it_cannot_serve(
    tmp_path: Path, name: str, reason: str
) -> None:
    """One message naming the architecture and the reason, exit code 2, no child started
    (BLOOM's config has no max_position_embeddings: the launcher used to die on it)."""
    folder = build_checkpoint(_arch(name, REFUSED), tmp_path / name)  # type: ignore[arg-type]
    proc = subprocess.run(
        [sys.executable, "-m", "cbpipe.launcher", "--model", str(folder), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("cbpipe-launch: ")]
    assert len(lines) == 1, proc.stderr
    assert "cannot be served by cbpipe" in lines[0] and reason in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
