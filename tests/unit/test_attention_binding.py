"""The route from a step to every attention layer: scoped, never leaking, compile-friendly."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig, StableLmConfig

from cbpipe.models import ModelSource
from cbpipe.worker.attention import AttentionVariant, StepBinding
from cbpipe.worker.attention.probe import ProbeStep, dense_attention
from cbpipe.worker.model_loader import load_paged_model

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _model(config_class: type = LlamaConfig):  # type: ignore[no-untyped-def]
    source = ModelSource("tiny", None, config_class(**SMALL))
    return load_paged_model(source, torch.device("cpu"), torch.float32)


def _forward(model: torch.nn.Module, n: int) -> torch.Tensor:
    ids = torch.arange(1, n + 1)[None]
    return model(input_ids=ids, position_ids=torch.arange(n)[None], use_cache=False).logits[0]


def test_bind_sets_the_step_for_the_block_only() -> None:
    binding = StepBinding()
    step = ProbeStep([0, 3])
    assert not binding.bound
    with binding.bind(step):
        assert binding.step is step
    assert not binding.bound
    with pytest.raises(RuntimeError, match="outside StepBinding.bind"):
        _ = binding.step


def test_bind_clears_when_the_forward_raises() -> None:
    binding = StepBinding()
    with pytest.raises(ValueError, match="boom"), binding.bind(ProbeStep([0, 1])):
        raise ValueError("boom")
    assert not binding.bound


def test_binds_do_not_nest() -> None:
    binding = StepBinding()
    with binding.bind(ProbeStep([0, 1])):
        with pytest.raises(RuntimeError, match="already bound"), binding.bind(ProbeStep([0, 1])):
            pass
        assert binding.bound  # the outer step is still the one bound
    assert not binding.bound


def test_each_model_gets_its_own_attention_function() -> None:
    (model_a, attention_a), (model_b, attention_b) = _model(), _model()
    assert attention_a.binding is not attention_b.binding
    name_a = model_a.config._attn_implementation
    assert name_a == attention_a.binding.attn_implementation
    assert name_a != model_b.config._attn_implementation
    # A step bound to one model's binding is not seen by the other's layers.
    with attention_a.binding.bind(ProbeStep([0, 4])), pytest.raises(RuntimeError, match="outside"):
        _forward(model_b, 4)


def test_a_model_registers_the_same_attention_name_in_every_process() -> None:
    """Dynamo names the compiled forward's shape symbols by a hash of the path to each
    input, and the registered name is in that path: a name that differs between launches
    (it held an ``id()``) gave the forward a new cache key in every process, so the compile
    cache never served it and every start-up compiled it afresh."""
    script = (
        "from cbpipe.worker.attention import StepBinding\n"
        "print(StepBinding().attn_implementation, StepBinding().attn_implementation)"
    )
    names = {
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    }
    assert len(names) == 1, names
    first, second = names.pop().split()
    assert first != second  # two models of one process still get their own


def test_a_forward_without_a_step_raises_instead_of_using_an_old_one() -> None:
    model, attention = _model()
    with attention.binding.bind(ProbeStep([0, 4])):
        _forward(model, 4)
    with pytest.raises(RuntimeError, match="outside StepBinding.bind"):
        _forward(model, 4)


def test_the_step_reaches_layers_that_drop_keyword_arguments() -> None:
    """StableLM's decoder layers pass no **kwargs on to attention."""
    model, attention = _model(StableLmConfig)
    step = ProbeStep([0, 5])
    with torch.inference_mode(), attention.binding.bind(step):
        _forward(model, 5)
    assert [call.layer for call in step.calls] == [0, 1]


@dataclass
class _ScalingStep:
    """A step whose attention is each row's value times the step's own tensor."""

    factor: torch.Tensor  # [1]

    def attend(self, layer, variant, query, key, value):  # type: ignore[no-untyped-def]
        group = query.shape[1] // value.shape[1]
        return value.repeat_interleave(group, dim=1) * self.factor


def test_compiled_forward_reads_each_new_step_through_the_binding() -> None:
    """One compiled graph serves every step (new step objects, new tensors, new lengths),
    and each forward uses the tensors of the step bound for it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, attention = _model()
    compiled = torch.compile(model, dynamic=True)
    graphs = []
    for n, factor in ((4, 1.0), (6, 0.5), (9, -2.0), (5, 3.0)):
        with torch.inference_mode():
            step = _ScalingStep(torch.tensor([factor]))
            with attention.binding.bind(step):
                eager = _forward(model, n)
            with attention.binding.bind(_ScalingStep(torch.tensor([factor]))):
                got = _forward(compiled, n)
        torch.testing.assert_close(got, eager)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and len(set(graphs)) == 1, f"graphs compiled after each step: {graphs}"


def test_dense_attention_matches_transformers_sliding_window_mask() -> None:
    """The window's edge, as transformers' own masks draw it: position p sees p - w < k <= p."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    n, window = 20, 6
    torch.manual_seed(0)
    query, key, value = (torch.randn(n, 1, 8) for _ in range(3))
    inside = sliding_window_causal_mask_function(window)
    pos = torch.arange(n)
    allowed = inside(0, 0, pos[:, None], pos[None, :])
    variant = AttentionVariant(scaling=1.0, sliding_window=window)
    got = dense_attention(query, key, value, [0, n], variant)[:, 0]  # [n, 8]
    scores = (query[:, 0] @ key[:, 0].T).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(got, scores.softmax(-1) @ value[:, 0])
    assert allowed.sum(1).tolist() == [min(q + 1, window) for q in range(n)]
