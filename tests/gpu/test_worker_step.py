"""The worker's step on CUDA: no host synchronisation, and carry-over across many steps."""

from __future__ import annotations

import random

import pytest
import torch

from cbpipe.models import resolve_model
from cbpipe.protocol.sampling import SamplingParams
from tests.harness import InProcessEngine, reference_model

pytestmark = pytest.mark.gpu

MODEL = "random:qwen2-tiny"
EMBEDDED = "default"


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


def test_replaying_a_decode_graph_never_synchronises_the_host() -> None:
    engine = InProcessEngine(MODEL, device=torch.device("cuda"), max_num_seqs=8)
    try:
        for n in (3, 17, 5):
            engine.add(list(range(5, 5 + n)), SamplingParams(max_new_tokens=8))
        prefill = engine.packer.pack(engine.scheduler.schedule(), 0, None)
        decode = engine.packer.pack(engine.scheduler.schedule(), 1, 0)  # carries every token
        assert decode.num_single_token_seqs == decode.num_seqs == 3
        assert engine.runner.graphs.find(decode) is not None
        engine.runner.launch(prefill).wait()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = engine.runner.launch(decode)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        launched.wait()
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("backend", "graphs", "prefill", "fuse", "compile_decode"),
    [
        ("auto", True, "auto", True, False),
        ("auto", True, "auto", True, True),
        ("triton", False, "torch", True, False),
        ("torch", False, "torch", False, False),
    ],
    ids=["defaults", "compiled", "triton-eager-torch-prefill", "torch-eager-unfused"],
)
def test_many_overlapping_steps_match_generate_on_cuda(
    backend: str, graphs: bool, prefill: str, fuse: bool, compile_decode: bool
) -> None:
    """Two steps really in flight on three streams, for hundreds of steps, with random
    switches between async and sync: greedy tokens equal transformers' ``generate`` on CUDA
    in float32. The embedded model is trained, so its top logits rarely tie (a random model's
    do, and then CUDA and CPU kernels may legitimately pick different tokens)."""
    source = resolve_model(EMBEDDED)
    rng = random.Random(11)
    prompts = [
        [rng.randrange(3, source.config.vocab_size) for _ in range(rng.randint(1, 200))]
        for _ in range(24)
    ]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 40), ignore_eos=True) for _ in prompts]
    cuda = torch.device("cuda")
    engine = InProcessEngine(
        EMBEDDED,
        max_batch_tokens=64,
        max_num_seqs=8,
        device=cuda,
        attention_backend=backend,
        cuda_graphs=graphs,
        prefill_backend=prefill,
        fuse_projections=fuse,
        compile_decode=compile_decode,
    )
    assert (len(engine.runner.graphs) > 0) == graphs
    try:
        outputs = engine.generate(prompts, params, mode="random", rng=random.Random(1))
    finally:
        engine.close()
    model = reference_model(EMBEDDED, cuda)
    for prompt, sp, output in zip(prompts, params, outputs, strict=True):
        expected = model.generate(
            torch.tensor([prompt], device=cuda),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=cuda),
            max_new_tokens=sp.max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert output == expected, f"prompt of {len(prompt)} tokens"
