"""Tiny random-weight checkpoints of transformers' decoder-only architectures, for the matrix.

Each ``Arch`` names a model type and the configuration that makes it small (a few layers of
hidden size 64) and exercises what the architecture does differently: a sliding window of
``WINDOW`` tokens that prompts and outputs cross, soft-capping with a cap low enough to
matter, sinks, custom scaling. ``build_checkpoint`` writes an ordinary checkpoint folder
(``save_pretrained``), which cbpipe loads as a user's folder would be loaded.

Random weights at the usual initialisation give nearly uniform attention, under which a
window, a cap or a sink hardly changes a greedy token; so the weights are redrawn with a
larger spread (``_redraw``), which makes attention peaked and the outputs depend on which
keys a row sees. ``disable_feature`` switches a feature off in a reference model, so a test
can check that the feature changes the reference at all (otherwise the test could not fail).

Shared by ``tests/correctness/test_architectures.py`` (float32 on the CPU) and
``scripts/check_architectures.py`` (bfloat16 on a GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

WINDOW = 12  # tokens; with blocks of 8 a window ends inside a block
_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
_GAIN = 2.0  # weights ~ N(0, (gain / sqrt(fan_in))^2): attention scores of a few units


@dataclass(frozen=True)
class Arch:
    """One architecture of the matrix: its tiny configuration and what it exercises."""

    model_type: str
    config: dict[str, Any] = field(default_factory=dict)  # over the common small sizes
    features: tuple[str, ...] = ()  # "window", "softcap", "sinks", "scaling"
    common: bool = True  # start from the common sizes (False: ``config`` is all)
    note: str = ""
    # The transformers version from which cbpipe serves it; before it, the model's own
    # attention code is refused (``refused_before``: a fragment of that refusal).
    served_from: str = ""
    refused_before: str = ""

    @property
    def name(self) -> str:
        return self.model_type


def _window(**extra: Any) -> dict[str, Any]:
    return {"sliding_window": WINDOW, **extra}


# Architectures cbpipe serves, each checked against ``generate``. Layer types alternate
# where the architecture does (Gemma 2: every other layer; Gemma 3, Cohere 2: all but every
# fourth with the pattern below; gpt-oss: every other).
SERVED = [
    Arch("llama"),
    Arch("mistral", _window(), ("window",), note="one window on every layer"),
    Arch("mixtral", _window(num_local_experts=4), ("window",)),
    Arch(
        "qwen2",
        _window(use_sliding_window=True, max_window_layers=2),
        ("window",),
        note="windows on the layers past max_window_layers",
    ),
    Arch(
        "qwen2_moe",
        dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    Arch("qwen3"),
    Arch("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    Arch("gemma", dict(head_dim=16)),
    Arch(
        "gemma2",
        _window(attn_logit_softcapping=2.0, final_logit_softcapping=30.0, query_pre_attn_scalar=2),
        ("window", "softcap", "scaling"),
        note="sliding and global layers alternate; attention soft-cap; query_pre_attn_scalar",
    ),
    Arch(
        "gemma3_text",
        _window(query_pre_attn_scalar=8, sliding_window_pattern=2),
        ("window", "scaling"),
        note="sliding and global layers; q/k norms; query_pre_attn_scalar",
    ),
    Arch("cohere", dict(logit_scale=1.0)),
    Arch("cohere2", _window(sliding_window_pattern=2, logit_scale=1.0), ("window",)),
    Arch("phi", dict(partial_rotary_factor=0.5)),
    Arch("phi3", _window(pad_token_id=0), ("window",)),
    Arch("stablelm", note="its decoder layers drop keyword arguments"),
    Arch("starcoder2", _window(), ("window",)),
    Arch("gpt2", dict(n_positions=512)),
    Arch("gpt_neox", dict(rotary_pct=0.5)),
    Arch(
        "gptj",
        dict(rotary_dim=8, n_positions=512),
        served_from="5.24",
        refused_before="from the model's own table",
    ),
    Arch("gpt_bigcode", dict(multi_query=True, n_positions=512), note="multi-query attention"),
    Arch(
        "codegen",
        dict(rotary_dim=8, n_positions=512, n_ctx=512),
        served_from="5.24",
        refused_before="compute attention without calling transformers' AttentionInterface",
    ),
    Arch("opt", dict(ffn_dim=128, word_embed_proj_dim=64), note="learned absolute positions"),
    Arch("olmo"),
    Arch("olmo2"),
    Arch(
        "granite",
        dict(
            attention_multiplier=0.5,
            logits_scaling=2.0,
            residual_multiplier=0.5,
            embedding_multiplier=2.0,
        ),
        ("scaling",),
    ),
    Arch("persimmon", dict(partial_rotary_factor=0.5)),
    Arch("helium"),
    Arch("glm", dict(partial_rotary_factor=0.5)),
    Arch("smollm3"),
    Arch(
        "gpt_oss",
        _window(num_local_experts=4, num_experts_per_tok=2),
        ("window", "sinks"),
        note="sliding and global layers alternate; attention sinks; mixture of experts",
    ),
]

# Architectures cbpipe refuses, with a fragment of the refusal message.
REFUSED = [
    Arch("falcon", dict(alibi=False), note="attention classes from its own table"),
    Arch(
        "bloom",
        dict(n_layer=2, n_head=4, hidden_size=64, vocab_size=256),
        common=False,
        note="attention outside AttentionInterface, ALiBi",
    ),
    Arch(
        "mpt",
        dict(d_model=64, n_heads=4, n_layers=2, vocab_size=256, expansion_ratio=2),
        common=False,
        note="attention outside AttentionInterface, ALiBi",
    ),
    Arch(
        "mamba",
        dict(hidden_size=64, num_hidden_layers=2, vocab_size=256, state_size=8),
        common=False,
        note="no attention: a state-space model",
    ),
    Arch(
        "rwkv",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            vocab_size=256,
            attention_hidden_size=64,
            intermediate_size=128,
            context_length=512,
        ),
        common=False,
        note="no attention: a recurrent model",
    ),
    Arch(
        "lfm2",
        dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),
        note="convolution layers",
    ),
    Arch(
        "jamba",
        dict(
            num_experts=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=8,
            mamba_dt_rank=8,
            mamba_expand=1,
        ),
        note="mamba layers",
    ),
    Arch(
        "falcon_h1",
        dict(
            mamba_d_state=8,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_ssm=64,
            mamba_chunk_size=16,
        ),
        note="attention and mamba side by side in every layer",
    ),
    Arch(
        "qwen3_next",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
        note="linear attention layers",
    ),
    Arch(
        "deepseek_v3",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=512,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=2,
            n_group=1,
            topk_group=1,
        ),
        common=False,
        note="multi-head latent attention",
    ),
    Arch(
        "bart",
        dict(
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            vocab_size=256,
            max_position_embeddings=512,
        ),
        common=False,
        note="BART's decoder alone: learned positions of the packed index",
    ),
    Arch(
        "reformer",
        dict(
            is_decoder=True,
            attn_layers=["local", "lsh"],
            axial_pos_shape=[16, 16],
            axial_pos_embds_dim=[32, 32],
            hidden_size=64,
            num_attention_heads=4,
            attention_head_size=16,
            feed_forward_size=128,
            local_attn_chunk_length=8,
            lsh_attn_chunk_length=8,
            num_buckets=4,
            vocab_size=256,
        ),
        common=False,
        note="its forward pads to chunks of its own: fails on a packed input",
    ),
]


def tiny_config(arch: Arch):  # type: ignore[no-untyped-def]
    """The architecture's configuration, small (transformers' ``AutoConfig.for_model``, so
    what the configuration derives, like ``layer_types``, follows the small sizes)."""
    from transformers import AutoConfig

    values = {**(_COMMON if arch.common else {}), **arch.config}
    default = AutoConfig.for_model(arch.model_type)
    settable = {}
    for key, value in values.items():
        try:  # some are derived properties (Falcon's head_dim): left to follow the others
            setattr(default, key, value)
        except AttributeError:
            continue
        settable[key] = value
    return AutoConfig.for_model(arch.model_type, **settable)


def build_checkpoint(arch: Arch, folder: Path, seed: int = 0) -> Path:
    """A random-weight checkpoint of ``arch`` in ``folder`` (created), as save_pretrained
    writes it."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw(model, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder


def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):  # one logit per head, of the size of the scores
                param.copy_(torch.randn(param.shape, generator=gen) * 2.0)
            elif param.dim() >= 2:
                std = _GAIN / math.sqrt(param.shape[-1])
                if "embed" in name or "wte" in name or "wpe" in name:
                    std = 1.0
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def disable_feature(model: torch.nn.Module, feature: str) -> None:
    """Switch ``feature`` off in a loaded reference model, in place."""
    config = model.config.get_text_config()
    if feature == "window":
        config.sliding_window = 1 << 20
        for module in model.modules():
            if getattr(module, "sliding_window", None) is not None:
                module.sliding_window = 1 << 20
    elif feature == "softcap":
        config.attn_logit_softcapping = None
        for module in model.modules():
            if hasattr(module, "attn_logit_softcapping"):
                module.attn_logit_softcapping = None
    elif feature == "sinks":
        for module in model.modules():
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, torch.Tensor):
                with torch.no_grad():
                    sinks.fill_(-1e4)  # exp(-1e4) is 0: no weight left for the sink
    elif feature == "scaling":
        for module in model.modules():
            if hasattr(module, "scaling") and hasattr(module, "head_dim"):
                module.scaling = module.head_dim**-0.5
    else:
        raise ValueError(feature)
