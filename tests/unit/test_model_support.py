"""Which models the configuration alone refuses, before any weight is loaded."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, LlamaConfig

from cbpipe.models.support import UnsupportedModel, check_config


def _refusal(config, max_model_len: int | None = None) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(UnsupportedModel) as refused:
        check_config(config, max_model_len)
    return str(refused.value)


def test_a_servable_model_gets_its_length_limit_or_the_flag() -> None:
    config = LlamaConfig(max_position_embeddings=4096)
    assert check_config(config) == 4096
    assert check_config(config, max_model_len=100) == 100


def test_no_length_limit_needs_the_flag() -> None:
    config = LlamaConfig()
    object.__setattr__(config, "max_position_embeddings", None)  # as a config without one
    message = _refusal(config)
    assert message.startswith("LlamaForCausalLM cannot be served by cbpipe: ")
    assert "pass --max-model-len" in message
    assert check_config(config, max_model_len=2048) == 2048


@pytest.mark.parametrize(
    ("model_type", "settings", "reason"),
    [
        ("bloom", {}, "compute attention themselves"),
        ("mpt", {}, "compute attention themselves"),
        ("falcon", {}, "Falcon's own table"),
        ("t5", {}, "encoder-decoder"),
        ("lfm2", {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]}, "conv"),
        ("llama4_text", {"attention_chunk_size": 8192}, "chunked local attention"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "bidirectional"),
    ],
)
def test_refused_with_the_reason(model_type: str, settings: dict, reason: str) -> None:
    config = AutoConfig.for_model(model_type, **settings)
    assert reason in _refusal(config)


def test_a_refused_model_is_not_told_to_pass_a_length() -> None:
    """BLOOM has no max_position_embeddings; the flag would not make it servable."""
    message = _refusal(AutoConfig.for_model("bloom"))
    assert "--max-model-len" not in message
