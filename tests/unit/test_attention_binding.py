"""The route from a step to every attention layer: scoped, never leaking, compile-friendly."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig, StableLmConfig

from cbpipe.models import ModelSource
from cbpipe.worker.attention import AttentionVariant, KVCache, OpaqueStep, PagedStep, StepBinding
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


def _mixed_step() -> tuple[PagedStep, dict[str, torch.Tensor]]:
    """A torch-path step on the CPU: one decode row (context 5), then a prefill chunk of 3
    rows after 2 cached ones; blocks of 4, each sequence's own."""
    torch.manual_seed(0)
    bs, kv_heads, heads, dim = 4, 2, 4, 8
    cache = KVCache([torch.randn(5 * bs, kv_heads, dim)], [torch.randn(5 * bs, kv_heads, dim)],
                    bs, 4)  # fmt: skip
    paged = PagedStep.build(
        cache,
        slot_mapping=torch.tensor([4, 10, 11, 12]),
        positions=torch.tensor([4, 2, 3, 4]),
        query_start=torch.tensor([0, 1, 4], dtype=torch.int32),
        context_lens=torch.tensor([5, 5], dtype=torch.int32),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        block_table_width=torch.tensor([2]),
        num_single_token_seqs=1,
        max_query_len=3,
        max_context_len=5,
        kv_group_size=heads // kv_heads,
    )
    rows = dict(
        query=torch.randn(heads, 4, dim).transpose(0, 1),  # a transposed view, as models give
        key=torch.randn(4, kv_heads, dim),
        value=torch.randn(4, kv_heads, dim),
        key_cache=cache.keys[0],
        value_cache=cache.values[0],
    )
    return paged, rows


def _op_args(rows: dict[str, torch.Tensor], binding: int) -> tuple[object, ...]:
    return (*rows.values(), binding, 0.5, None, None, None)


def test_the_step_attention_op_runs_the_bound_steps_attention() -> None:
    """``cbpipe::step_attention`` is how a compiled layer reaches the step: it finds the
    ``OpaqueStep`` bound to the binding it names and runs its step, caches and all."""
    paged, rows = _mixed_step()
    expected_rows = {name: t.clone() for name, t in rows.items()}
    expected = paged.attend_cache(AttentionVariant(0.5), expected_rows["query"],
                                  expected_rows["key_cache"], expected_rows["value_cache"],
                                  expected_rows["key"], expected_rows["value"])  # fmt: skip
    binding, other = StepBinding(), StepBinding()
    op = torch.ops.cbpipe.step_attention.default
    with binding.bind(OpaqueStep(paged, binding.number)):
        got = op(*_op_args(rows, binding.number))
        with pytest.raises(RuntimeError, match="outside StepBinding.bind"):
            op(*_op_args(rows, other.number))  # another model's binding: nothing bound there
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(rows["key_cache"], expected_rows["key_cache"])
    torch.testing.assert_close(rows["value_cache"], expected_rows["value_cache"])
    with binding.bind(paged), pytest.raises(RuntimeError, match="with a PagedStep bound"):
        op(*_op_args(rows, binding.number))


def test_the_step_attention_op_declares_what_it_mutates_and_returns() -> None:
    paged, rows = _mixed_step()
    binding = StepBinding()
    with binding.bind(OpaqueStep(paged, binding.number)):
        torch.library.opcheck(
            torch.ops.cbpipe.step_attention.default,
            _op_args(rows, binding.number),
            test_utils=("test_schema", "test_faketensor"),
        )


def test_the_compiled_step_attention_op_stores_into_the_caches_in_place() -> None:
    """Under torch.compile ``cbpipe::step_attention`` mutates the caches themselves: a copy
    of a cache (in a server gigabytes a layer, every layer of every step, decode graphs
    included) would show as a clone or a copy back in inductor's code."""
    from torch._inductor.utils import run_and_get_code

    paged, rows = _mixed_step()
    expected_rows = {name: t.clone() for name, t in rows.items()}
    expected = paged.attend_cache(AttentionVariant(0.5), expected_rows["query"],
                                  expected_rows["key_cache"], expected_rows["value_cache"],
                                  expected_rows["key"], expected_rows["value"])  # fmt: skip
    binding = StepBinding()
    key_cache, value_cache = rows["key_cache"], rows["value_cache"]

    def layer(query: torch.Tensor, half_keys: torch.Tensor) -> torch.Tensor:
        key = half_keys * 2  # an element-wise kernel produces the keys
        return torch.ops.cbpipe.step_attention(query, key, rows["value"], key_cache,
                                               value_cache, binding.number, 0.5, None, None,
                                               None)  # fmt: skip

    with binding.bind(OpaqueStep(paged, binding.number)):
        compiled = torch.compile(layer, fullgraph=True)
        got, code = run_and_get_code(compiled, rows["query"], rows["key"] / 2)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(key_cache, expected_rows["key_cache"])
    torch.testing.assert_close(value_cache, expected_rows["value_cache"])
    source = "\n".join(code)
    assert "step_attention" in source
    assert "clone" not in source and "copy_" not in source, source
