"""Every architecture cbpipe claims, against ``generate``; every one it refuses, refused.

Each architecture of ``tests/architectures.py`` is a tiny random-weight checkpoint written
with ``save_pretrained`` and loaded from its folder as a user's checkpoint would be. The
engine (scheduler core, packer and worker runner, in the engine's call order: see
``tests/harness.py``) serves prompts that cross the sliding window (``WINDOW`` tokens) and the
block edges (blocks of 8), with chunked prefill (a budget of 24 tokens per step), and must
return exactly what transformers' ``generate`` returns, greedy, float32. Where the
architecture has a sliding window, a soft-cap, sinks or custom scaling, the reference with
that feature switched off must differ for some prompt: otherwise the weights do not make the
feature matter and the comparison could not catch its absence.

Gemma 2 (sliding and global layers, soft-cap, custom scaling) and gpt-oss (sliding and global
layers, sinks) also run through the Triton kernels (under Triton's CPU interpreter, which is
slow: fewer prompts there) and the padded decode-graph bodies with the attention ops.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

from cbpipe.models import resolve_model
from cbpipe.models.support import UnsupportedModel
from cbpipe.protocol.sampling import SamplingParams
from cbpipe.worker.model_loader import load_paged_model
from tests.architectures import REFUSED, SERVED, WINDOW, Arch, build_checkpoint, disable_feature
from tests.harness import InProcessEngine, reference_greedy, reference_model

VOCAB = 256
# Prompt lengths around the window and the blocks of 8: outputs of 12 tokens take the
# shortest past the window; the longest is prefilled in two chunks, each past the window.
PROMPT_LENS = (1, WINDOW - 1, WINDOW + 1, 17, 40)
KERNEL_PROMPT_LENS = (WINDOW - 1, 17, 40)
KERNEL_ARCHS = ("gemma2", "gpt_oss")
MAX_NEW_TOKENS = 12
REFUSAL_MESSAGES = {
    "falcon": "Falcon's own table",
    "bloom": "compute attention themselves",
    "mpt": "compute attention themselves",
    "mamba": "layers of type",
    "rwkv": "without calling transformers' AttentionInterface",
    "lfm2": "layers of type conv",
    "jamba": "layers of type",
    "falcon_h1": "layers of type hybrid",
    "qwen3_next": "layers of type linear_attention",
    "deepseek_v3": "multi-head latent attention",
    "bart": "mixes tokens outside attention",
    "reformer": "its forward failed on two sequences packed",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("architectures")


def _checkpoint(arch: Arch, root: Path) -> str:
    folder = root / arch.name
    if not (folder / "config.json").exists():
        build_checkpoint(arch, folder)
    return str(folder)


def _prompts(lengths: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    output = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return output[0, len(prompt) :].tolist()


def _serve(name: str, prompts: list[list[int]], **engine: object) -> list[list[int]]:
    params = [SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True) for _ in prompts]
    harness = InProcessEngine(
        name,
        num_blocks=64,
        block_size=8,
        max_num_seqs=4,
        max_batch_tokens=24,
        max_model_len=128,
        **engine,  # type: ignore[arg-type]
    )
    outputs = harness.generate(prompts, params, mode="random", rng=random.Random(3))
    assert harness.blocks.num_free_blocks == harness.num_blocks
    return outputs


@pytest.mark.parametrize("arch", SERVED, ids=lambda a: a.name)
def test_architecture_matches_generate(arch: Arch, checkpoints: Path) -> None:
    name = _checkpoint(arch, checkpoints)
    expected = [reference_greedy(name, p, MAX_NEW_TOKENS, None) for p in _prompts()]
    assert len({tuple(e) for e in expected}) > 1, "every prompt gives the same output"
    try:
        outputs = _serve(name, _prompts())
    except UnsupportedModel as refused:
        # Older transformers: served correctly, or refused for its own attention code (as
        # 5.17 refuses it), never answered wrongly.
        if not arch.served_from or Version(transformers.__version__) >= Version(arch.served_from):
            raise
        assert arch.refused_before in str(refused), refused
        return
    assert outputs == expected
    for feature in arch.features:
        model = reference_model.__wrapped__(name)  # a fresh copy to switch the feature off in
        disable_feature(model, feature)
        without = [_greedy(model, p) for p in _prompts()]
        assert without != expected, f"switching {feature} off does not change the reference"


@pytest.mark.parametrize(
    "arch", [a for a in SERVED if a.name in KERNEL_ARCHS], ids=lambda a: a.name
)
def test_architecture_through_the_triton_kernels(arch: Arch, checkpoints: Path) -> None:
    """The prefill and decode kernels (interpreted) and the decode-graph bodies with the
    attention ops, with each layer's variant."""
    name = _checkpoint(arch, checkpoints)
    prompts = _prompts(KERNEL_PROMPT_LENS)
    expected = [reference_greedy(name, p, MAX_NEW_TOKENS, None) for p in prompts]
    outputs = _serve(name, prompts, attention_backend="triton", prefill_backend="triton")
    assert outputs == expected


@pytest.mark.parametrize("arch", REFUSED, ids=lambda a: a.name)
def test_architecture_is_refused_with_its_reason(arch: Arch, checkpoints: Path) -> None:
    name = _checkpoint(arch, checkpoints)
    with pytest.raises(UnsupportedModel) as refused:
        load_paged_model(resolve_model(name), torch.device("cpu"), torch.float32)
    message = str(refused.value)
    assert message.startswith(refused.value.architecture + " cannot be served by cbpipe: ")
    assert REFUSAL_MESSAGES[arch.name] in message, message


def test_a_window_only_transformers_cache_applies_is_refused_past_it(checkpoints: Path) -> None:
    """A configuration that sets ``sliding_window`` for an architecture whose attention
    ignores it (Llama's, Moshi's) gets a windowed cache in ``generate``: all keys in its
    prefill, a window in its decode steps. Refused past the window; served within it."""
    name = _checkpoint(Arch("llama", {"sliding_window": WINDOW}), checkpoints / "stray_window")
    with pytest.raises(UnsupportedModel, match=f"sets sliding_window {WINDOW}.*--max-model-len"):
        load_paged_model(resolve_model(name), torch.device("cpu"), torch.float32)
    prompts = _prompts((1, WINDOW - MAX_NEW_TOKENS // 2))
    expected = [reference_greedy(name, p, WINDOW - len(p), None) for p in prompts]
    params = [SamplingParams(max_new_tokens=WINDOW - len(p), ignore_eos=True) for p in prompts]
    harness = InProcessEngine(name, num_blocks=16, block_size=8, max_model_len=WINDOW)
    assert harness.generate(prompts, params, mode="async") == expected
