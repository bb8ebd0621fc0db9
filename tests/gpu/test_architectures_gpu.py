"""Attention variants on CUDA: sliding windows, soft-cap and sinks through the kernels, the
decode graphs and the compiled path, and a warm-up that leaves no kernel to compile later.

The models are the matrix's tiny checkpoints (``tests/architectures.py``): Gemma 2 (sliding
and global layers, soft-cap, custom scaling) and gpt-oss (sliding and global layers, sinks),
in float32 against transformers' ``generate`` on the same device. Outputs must be equal, or
part at a near-tie of the reference's two top logits (below ``FP32_TIE``), where CUDA's and
transformers' different shapes may legitimately pick the other token.
"""

from __future__ import annotations

import random

import pytest
import torch

from cbpipe.protocol.sampling import SamplingParams
from cbpipe.worker.cuda_graphs import capture_blocker
from tests.architectures import SERVED, WINDOW, build_checkpoint
from tests.gpu.test_worker_step import _compiled_kernel_variants
from tests.harness import InProcessEngine, reference_model

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
FP32_TIE = 1e-3
VOCAB = 256
MAX_NEW_TOKENS = 16
VARIANT_ARCHS = ("gemma2", "gpt_oss", "mistral")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpu-architectures")
    return {
        a.name: str(build_checkpoint(a, root / a.name)) for a in SERVED if a.name in VARIANT_ARCHS
    }


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, WINDOW - 1, WINDOW + 1, 40, 100] + [rng.randint(1, 120) for _ in range(count)]
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def _check_against_generate(name: str, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """Each output against greedy decoding by the model's own forward over the whole sequence,
    step by step (no cache: what ``generate`` computes, without the cache classes and the
    compiled static-cache path that ``generate`` takes on CUDA); a difference within a float32
    tie is accepted. ``generate``'s own tokens are printed beside it where they differ."""
    model = reference_model(name, CUDA)
    failures = []
    for prompt, got in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt], device=CUDA)
        generated = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None, pad_token_id=0,
        )[0, len(prompt) :].tolist()  # fmt: skip
        sequence = list(prompt)
        for i, token in enumerate(got):
            logits = model(input_ids=torch.tensor([sequence], device=CUDA)).logits[0, -1]
            want = int(logits.argmax())
            if token != want:
                gap = float(logits[want] - logits[token])
                print(f"  prompt of {len(prompt)}: token {i} is {token} for {want}, gap {gap:.2e}")
                if gap > FP32_TIE:
                    failures.append(f"prompt of {len(prompt)} differs at token {i}, gap {gap:.2e}")
                break
            sequence.append(token)
        if generated != got:
            print(f"  prompt of {len(prompt)}: generate gave {generated}, the engine {got}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("arch", VARIANT_ARCHS)
@pytest.mark.parametrize(
    ("backend", "graphs", "compile_decode"),
    [("auto", True, False), ("auto", True, True), ("auto", False, False), ("torch", False, False)],
    ids=["graphs", "compiled", "eager-kernels", "torch-path"],
)
def test_variant_models_match_generate_on_cuda(
    arch: str, backend: str, graphs: bool, compile_decode: bool, folders: dict[str, str]
) -> None:
    name = folders[arch]
    prompts = _prompts(7, 11)
    params = [SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True) for _ in prompts]
    engine = InProcessEngine(
        name,
        block_size=8,
        max_num_seqs=8,
        max_batch_tokens=48,
        device=CUDA,
        attention_backend=backend,
        prefill_backend=backend,
        cuda_graphs=graphs,
        compile_decode=compile_decode,
    )
    # float32 experts cannot be captured (cuda_graphs.capture_blocker): eager decodes.
    captured = graphs and capture_blocker(engine.runner.model) is None
    assert (len(engine.runner.graphs) > 0) == captured
    try:
        outputs = engine.generate(prompts, params, mode="random", rng=random.Random(1))
    finally:
        engine.close()
    _check_against_generate(name, prompts, outputs)


@pytest.mark.parametrize("arch", ("gemma2", "gpt_oss"))
def test_no_kernel_compiles_while_serving_a_variant_model(
    arch: str, folders: dict[str, str]
) -> None:
    """Layers with and without a window, with a soft-cap or sinks, are compiled variants of
    the kernels: the warm-up must meet them all, so none compiles mid-run."""
    before_start = _compiled_kernel_variants()
    # Block size 4: constants no other test uses, so this engine's variants are new here.
    engine = InProcessEngine(
        folders[arch],
        block_size=4,
        max_batch_tokens=96,
        max_num_seqs=12,
        device=CUDA,
        cuda_graphs=False,  # eager decode steps: every batch size takes the kernels
    )
    try:
        after_start = _compiled_kernel_variants()
        assert after_start > before_start
        prompts = _prompts(5, 35)
        params = [
            SamplingParams(max_new_tokens=random.Random(i).randint(1, 30), ignore_eos=True)
            for i in range(len(prompts))
        ]
        engine.generate(prompts, params, mode="random", rng=random.Random(2))
        assert _compiled_kernel_variants() == after_start
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ("gemma2", "gpt_oss"))
def test_variant_steps_never_synchronise_the_host(arch: str, folders: dict[str, str]) -> None:
    """Windows, soft-cap and sinks are launch arguments: enqueueing an eager step (prefill
    chunks and decodes) or replaying a decode graph reads nothing back from the device."""
    # bfloat16: graphs of every architecture capture in it (cuda_graphs.capture_blocker)
    engine = InProcessEngine(
        folders[arch], block_size=8, max_batch_tokens=64, device=CUDA, dtype=torch.bfloat16
    )
    try:
        for n in (1, 40, 3, 90):
            engine.add(list(range(5, 5 + n)), SamplingParams(max_new_tokens=8))
        plans = [engine.scheduler.schedule()]  # prefill chunks
        steps = [engine.packer.pack(plans[0], 0, None)]
        plans.append(engine.scheduler.schedule())  # chunks, and decodes that carry tokens
        steps.append(engine.packer.pack(plans[1], 1, 0))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = [engine.runner.launch(step) for step in steps]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for slot, (plan, item) in enumerate(zip(plans, launched, strict=True)):
            item.wait()
            engine.scheduler.update(plan, engine.packer.read_output(slot, steps[slot]))
        replayed = False
        while engine.scheduler.has_work and not replayed:  # on to decode-only steps
            plan = engine.scheduler.schedule()
            step = engine.packer.pack(plan, 2, None)
            replayed = engine.runner.graphs.find(step) is not None
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if replayed else "default")
            try:
                item = engine.runner.launch(step)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            item.wait()
            engine.scheduler.update(plan, engine.packer.read_output(2, step))
        assert replayed, "no decode step replayed a graph"
    finally:
        engine.close()
