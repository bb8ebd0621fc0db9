"""Which models the worker ranks can split, decided before any collective runs."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig

from cbpipe.models import resolve_model
from cbpipe.models.support import UnsupportedModel, check_tensor_parallel
from cbpipe.worker.tensor_parallel import check_shardable, model_tp_plan


def _tiny_llama(**overrides: object) -> LlamaConfig:
    values = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    return LlamaConfig(**{**values, **overrides})


def test_the_embedded_model_splits_in_two_but_not_in_four() -> None:
    config = resolve_model("default").config
    check_tensor_parallel(config, 2)
    with pytest.raises(UnsupportedModel, match=r"LlamaForCausalLM.*2 kv heads.*4 ranks"):
        check_tensor_parallel(config, 4)


def test_a_configuration_without_a_plan_is_refused() -> None:
    config = _tiny_llama()
    config.base_model_tp_plan = None
    with pytest.raises(UnsupportedModel, match="no tensor-parallel plan"):
        check_tensor_parallel(config, 2)
    check_tensor_parallel(config, 1)  # size 1 needs none


def test_every_linear_layer_has_a_style_and_one_left_out_is_refused() -> None:
    model = AutoModelForCausalLM.from_config(_tiny_llama())
    styles = check_shardable(model, 2)
    assert styles["model.layers.0.self_attn.q_proj"] == "colwise"
    assert styles["model.layers.0.mlp.down_proj"] == "rowwise"
    assert styles["lm_head"] == "colwise_gather_output"
    assert model_tp_plan(model)["model.embed_tokens"] == "embedding_rowwise"  # kept whole
    plan = model.config.base_model_tp_plan
    model.config.base_model_tp_plan = {k: v for k, v in plan.items() if "up_proj" not in k}
    model._tp_plan = {k: v for k, v in model._tp_plan.items() if "up_proj" not in k}
    with pytest.raises(UnsupportedModel, match=r"does not say how to split .*up_proj"):
        check_shardable(model, 2)


def test_a_vocabulary_the_ranks_cannot_split_is_refused() -> None:
    model = AutoModelForCausalLM.from_config(_tiny_llama(vocab_size=63))
    with pytest.raises(UnsupportedModel, match="lm_head's 63 outputs"):
        check_shardable(model, 2)
