"""Which models cbpipe serves, decided from the configuration alone (no weights).

The launcher calls ``check_config`` before any child starts, so a model cbpipe cannot serve
correctly is refused with one message naming the architecture and the reason; the worker
calls it again before loading weights, then probes the loaded model
(``cbpipe/worker/attention/probe.py``), which finds what the configuration cannot show (layers
that bypass transformers' attention interface, token mixing outside attention, attention
arguments cbpipe does not implement).
"""

from __future__ import annotations

from transformers import PretrainedConfig

# Architectures the configuration alone refuses, with the reason; checked against
# transformers 5.17-5.24. The probe would refuse them too, but later and less clearly (Falcon
# does not even load with a custom attention implementation).
REFUSED_MODEL_TYPES = {
    "falcon": (
        "its layers pick their attention class from Falcon's own table, not from "
        "transformers' AttentionInterface, so the paged KV cache would be bypassed"
    ),
    "bloom": (
        "its layers compute attention themselves (with ALiBi biases), without transformers' "
        "AttentionInterface, so the paged KV cache would be bypassed"
    ),
    "mpt": (
        "its layers compute attention themselves (with ALiBi biases), without transformers' "
        "AttentionInterface, so the paged KV cache would be bypassed"
    ),
}
# Layer kinds of ``config.layer_types`` that paged attention computes.
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


class UnsupportedModel(ValueError):
    """A model cbpipe cannot serve correctly; the message names the architecture and why."""

    def __init__(self, architecture: str, reasons: list[str]) -> None:
        self.architecture = architecture
        self.reasons = reasons
        super().__init__(f"{architecture} cannot be served by cbpipe: " + "; ".join(reasons))


def architecture_name(config: PretrainedConfig) -> str:
    """The model class a checkpoint names, else the causal-LM class of its model type."""
    names = getattr(config, "architectures", None)
    if names:
        return str(names[0])
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return str(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type))


def length_limit(config: PretrainedConfig) -> int | None:
    """The longest sequence the configuration allows, if it names one."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def check_config(config: PretrainedConfig, max_model_len: int | None = None) -> int:
    """The longest sequence to serve (``max_model_len``, else the model's own limit).

    Raises ``UnsupportedModel`` with every reason the configuration shows.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = config.get_text_config()
    reasons = []
    if getattr(config, "is_encoder_decoder", False):
        reasons.append("it is an encoder-decoder model; cbpipe serves decoder-only causal LMs")
    elif config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        reasons.append(f"transformers has no causal-LM class for model type {config.model_type!r}")
    if config.model_type in REFUSED_MODEL_TYPES:
        reasons.append(REFUSED_MODEL_TYPES[config.model_type])
    elif _uses_alibi(config):
        reasons.append("it uses ALiBi position biases, which cbpipe's kernels do not implement")
    layer_types = getattr(text, "layer_types", None) or ()
    unsupported = sorted({str(t) for t in layer_types} - SUPPORTED_LAYER_TYPES)
    if unsupported:
        reasons.append(
            f"it has layers of type {', '.join(unsupported)}; cbpipe computes "
            + " and ".join(sorted(SUPPORTED_LAYER_TYPES))
            + " layers only"
        )
    if getattr(text, "attention_chunk_size", None):
        reasons.append("chunked local attention (attention_chunk_size) is not implemented")
    if getattr(text, "use_bidirectional_attention", False):
        reasons.append("bidirectional attention (use_bidirectional_attention) is not causal")
    limit = max_model_len or length_limit(config)
    if limit is None and not reasons:  # only worth saying of a model that is otherwise served
        reasons.append(
            "its configuration sets no max_position_embeddings, so there is no length limit "
            "to size the KV cache and the slots by: pass --max-model-len"
        )
    if reasons:
        raise UnsupportedModel(architecture_name(config), reasons)
    assert limit is not None
    return limit


def _uses_alibi(config: PretrainedConfig) -> bool:
    if getattr(config, "alibi", False) or getattr(config, "use_alibi", False):
        return True
    attn_config = getattr(config, "attn_config", None)
    if isinstance(attn_config, dict):
        return bool(attn_config.get("alibi"))
    return bool(getattr(attn_config, "alibi", False))


def reference_attention(config: PretrainedConfig) -> str | None:
    """The ``attn_implementation`` to check cbpipe against: transformers' choice (SDPA where
    the model supports it), except eager for attention soft-capping, which SDPA cannot compute
    and some transformers versions (5.17's Gemma 2) still dispatch to it, dropping the cap."""
    capped = getattr(config.get_text_config(), "attn_logit_softcapping", None)
    return "eager" if capped else None


def own_attention_table_error(config: PretrainedConfig, exc: KeyError) -> UnsupportedModel:
    """The refusal of a model class that looks its attention class up in a table of its own
    (a ``KeyError`` for cbpipe's registered name while it is built)."""
    return UnsupportedModel(
        architecture_name(config),
        [
            f"its layers pick their attention class from the model's own table (no entry "
            f"{exc.args[0]!r}), not from transformers' AttentionInterface, so the paged KV "
            "cache would be bypassed"
        ],
    )


def check_tensor_parallel(config: PretrainedConfig, world_size: int) -> None:
    """Refuse, from the configuration alone, a model the worker ranks cannot split exactly:
    no tensor-parallel plan, or heads, kv heads or MLP columns that do not divide into
    ``world_size`` (the worker checks each layer of the loaded model again)."""
    if world_size == 1:
        return
    text_config = config.get_text_config()

    def refuse(reason: str) -> UnsupportedModel:
        return UnsupportedModel(
            architecture_name(config), [f"at --tensor-parallel-size {world_size}, {reason}"]
        )

    if not getattr(text_config, "base_model_tp_plan", None):
        raise refuse("its configuration has no tensor-parallel plan (base_model_tp_plan)")
    divided = (
        ("attention heads", "num_attention_heads"),
        ("kv heads", "num_key_value_heads"),
        ("MLP columns", "intermediate_size"),
    )
    for what, key in divided:
        value = getattr(text_config, key, None)
        if isinstance(value, int) and value % world_size:
            raise refuse(f"its {value} {what} ({key}) do not divide into {world_size} ranks")
