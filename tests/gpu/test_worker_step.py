"""The worker's step on CUDA: no host synchronisation, and carry-over across many steps."""

from __future__ import annotations

import random

import pytest
import torch

from cbpipe.protocol.sampling import SamplingParams
from tests.harness import InProcessEngine

pytestmark = pytest.mark.gpu

MODEL = "random:qwen2-tiny"


def test_enqueueing_a_step_never_synchronises_the_host() -> None:
    engine = InProcessEngine(MODEL, device=torch.device("cuda"), max_batch_tokens=64)
    try:
        for n in (1, 40, 3, 90):
            engine.add(list(range(5, 5 + n)), SamplingParams(max_new_tokens=4))
        first = engine.scheduler.schedule()  # prefill chunks
        second = engine.scheduler.schedule()  # chunks and decodes that carry tokens over
        steps = [engine.packer.pack(first, 0, None), engine.packer.pack(second, 1, 0)]
        assert steps[1].carry_from_slot == 0
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = [engine.runner.launch(step) for step in steps]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for item in launched:
            item.wait()
    finally:
        engine.close()


def test_many_overlapping_steps_match_a_cpu_run() -> None:
    """Greedy tokens on CUDA in float32 equal the same requests run on the CPU."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 200))] for _ in range(24)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 40)) for _ in prompts]
    cpu = InProcessEngine(MODEL, max_batch_tokens=64, max_num_seqs=8)
    gpu = InProcessEngine(MODEL, max_batch_tokens=64, max_num_seqs=8,
                          device=torch.device("cuda"))  # fmt: skip
    try:
        expected = cpu.generate(prompts, params, mode="random", rng=random.Random(1))
        assert gpu.generate(prompts, params, mode="random", rng=random.Random(1)) == expected
    finally:
        gpu.close()
