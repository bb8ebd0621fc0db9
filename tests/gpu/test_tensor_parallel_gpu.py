"""Tensor parallelism on two GPUs (NCCL, bfloat16, decode from CUDA graphs): the same
requests at ``--tensor-parallel-size`` 2 and 1, on one checkpoint of Llama-3-8B's shape.

The random preset is not used directly: at size 2 a preset materialises only each rank's
shard, from a random stream that follows the shard shapes, so its weights are not size 1's.
A checkpoint folder written once gives both sizes the same weights. In bfloat16 the two
sizes sum the row-parallel products in another order (two partial products and an
all-reduce), so tokens may part at near-ties; the test prints how many requests match
exactly and asks that most agree on their first ``PREFIX`` tokens. Run by
``scripts/gpu_check.sh`` (PARTS=tp) on a machine with two GPUs; skipped elsewhere.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cbpipe.client import Client
from cbpipe.engine_process import EngineProcess

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

NUM_REQUESTS = 32
PROMPT_LEN = 128
MAX_NEW_TOKENS = 64
PREFIX = 8
START_TIMEOUT_S = 600.0


@pytest.fixture(scope="module")
def llama8b_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """random:llama-8b's weights (seeded, made on GPU 0) saved as a checkpoint folder."""
    from transformers import AutoModelForCausalLM

    from cbpipe.models import resolve_model

    folder = tmp_path_factory.mktemp("tp") / "llama8b"
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = AutoModelForCausalLM.from_config(
            resolve_model("random:llama-8b").config, dtype=torch.bfloat16
        )
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    yield folder


def _tokens(folder: Path, size: int, prompts: list[list[int]], *extra: str) -> list[list[int]]:
    flags = ["--model", str(folder), "--device", "cuda", "--dtype", "bfloat16",
             "--tensor-parallel-size", str(size), *extra]  # fmt: skip
    engine = EngineProcess.spawn(flags)
    try:
        engine.wait_ready(START_TIMEOUT_S)
        with Client(engine.address) as client:
            results = client.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        return [r.token_ids for r in results]
    finally:
        engine.stop()


@pytest.mark.parametrize("extra", [(), ("--compile-decode",)], ids=["graphs", "compiled"])
def test_size_2_matches_size_1_in_bfloat16(llama8b_folder: Path, extra: tuple[str, ...]) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(PROMPT_LEN)] for _ in range(32)]
    one = _tokens(llama8b_folder, 1, prompts, *extra)
    two = _tokens(llama8b_folder, 2, prompts, *extra)
    exact = sum(a == b for a, b in zip(one, two, strict=True))
    prefix = sum(a[:PREFIX] == b[:PREFIX] for a, b in zip(one, two, strict=True))
    parts = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
             for a, b in zip(one, two, strict=True)]  # fmt: skip
    print(
        f"\nTP=2 vs TP=1, bfloat16 {' '.join(extra) or 'graphs'}: {exact} of {len(prompts)} "
        f"requests match exactly, {prefix} in their first {PREFIX} tokens; first differences "
        f"at {parts}"
    )
    assert prefix >= 0.75 * len(prompts)
