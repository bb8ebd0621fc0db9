"""Which models the worker ranks can split, decided before any collective runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from cbpipe.models import EMBEDDED_MODEL_DIR, resolve_model
from cbpipe.models.support import UnsupportedModel, check_tensor_parallel
from cbpipe.worker.model_loader import load_model
from cbpipe.worker.tensor_parallel import (
    REPLICATED,
    TensorParallel,
    check_shardable,
    checkpoint_tensors,
    model_tp_plan,
    shard_model,
)


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
    # Newer transformers plan the embeddings vocabulary-parallel (5.17 does not name them):
    # a style we keep whole either way.
    assert model_tp_plan(model).get("model.embed_tokens", "embedding_rowwise") in REPLICATED
    plan = model.config.base_model_tp_plan
    model.config.base_model_tp_plan = {k: v for k, v in plan.items() if "up_proj" not in k}
    model._tp_plan = {k: v for k, v in model._tp_plan.items() if "up_proj" not in k}
    with pytest.raises(UnsupportedModel, match=r"does not say how to split .*up_proj"):
        check_shardable(model, 2)


def test_a_vocabulary_the_ranks_cannot_split_is_refused() -> None:
    model = AutoModelForCausalLM.from_config(_tiny_llama(vocab_size=63))
    with pytest.raises(UnsupportedModel, match="lm_head's 63 outputs"):
        check_shardable(model, 2)


def _whole_then_sharded(folder: str, tp: TensorParallel) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    shard_model(model, tp)
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("arch", ["default", "qwen2"])
def test_a_rank_reads_exactly_its_slices_of_a_safetensors_checkpoint(
    arch: str, tmp_path: Path
) -> None:
    """Each rank's shard, read slice by slice from the files, equals the whole checkpoint
    loaded by transformers and then sharded: every parameter and buffer, tied head
    included (the embedded model ties it; the Qwen2 has biases on q, k and v)."""
    from tests.architectures import Arch, build_checkpoint

    if arch == "default":
        folder = str(EMBEDDED_MODEL_DIR)
    else:
        config = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}
        folder = str(build_checkpoint(Arch("qwen2", config), tmp_path / "qwen2"))
    source = resolve_model(folder)

    def whole(*args: object, **kwargs: object) -> None:
        raise AssertionError("the checkpoint was loaded whole, not read in slices")

    for rank in range(2):
        tp = TensorParallel(rank, 2)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(AutoModelForCausalLM, "from_pretrained", whole)
            read = load_model(source, torch.device("cpu"), torch.float32, tp=tp)
        got = {**dict(read.named_parameters()), **dict(read.named_buffers())}
        want = _whole_then_sharded(folder, tp)
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (rank, name)
        if source.config.get_text_config().tie_word_embeddings:
            head, embedding = read.get_output_embeddings(), read.get_input_embeddings()
            rows = tp.rows(head.full_out_features)
            assert head.weight.data_ptr() == embedding.weight[rows].data_ptr()  # a view


def test_a_checkpoint_under_other_names_is_not_read_in_slices(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_config(_tiny_llama())
    save_file({f"renamed.{k}": v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    assert checkpoint_tensors(model, tmp_path) is None
    assert checkpoint_tensors(model, tmp_path / "nothing-here") is None
