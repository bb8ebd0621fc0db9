"""The decode forward compiled a layer at a time: one graph for every layer, each layer still
reading its own weights and KV cache, the layers' siblings (the final norm, the rotary
tables) a graph each, the embedding and the head eager, and the eager model untouched."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig

from cbpipe.models import ModelSource
from cbpipe.worker.attention import KVCache, attach_kv_cache, layer_cache
from cbpipe.worker.compiled_layers import compile_layers
from cbpipe.worker.model_loader import load_paged_model
from tests.unit.test_attention_binding import SMALL, _forward

CONFIG = SMALL | {"num_hidden_layers": 4}


@dataclass
class _CacheReadingStep:
    """Attention that is each row's value plus the mean of its layer's cached keys: a
    compiled layer that read another layer's cache (or baked in the first one's) differs."""

    def attend(self, layer, variant, query, key, value):  # type: ignore[no-untyped-def]
        keys, _ = layer_cache(layer)
        group = query.shape[1] // value.shape[1]
        return value.repeat_interleave(group, dim=1) + keys.mean()


def test_one_graph_serves_every_layer_with_its_own_cache() -> None:
    """Three graphs: the layers' one, the final norm's and the rotary tables'."""
    torch._dynamo.reset()
    counters.clear()
    model, attention = load_paged_model(
        ModelSource("tiny", None, LlamaConfig(**CONFIG)), torch.device("cpu"), torch.float32
    )
    shape = (8, attention.num_kv_heads, attention.head_dim)
    kv = KVCache([torch.full(shape, float(i)) for i in range(4)], [torch.zeros(shape)] * 4, 4, 1)
    attach_kv_cache(kv, [layer.module for layer in attention.layers])
    decode = compile_layers(model, lambda m: torch.compile(m, dynamic=True, backend="eager"))
    with torch.inference_mode():
        for n in (5, 9, 3):
            with attention.binding.bind(_CacheReadingStep()):
                eager = _forward(model, n)
            with attention.binding.bind(_CacheReadingStep()):
                compiled = _forward(decode, n)
            torch.testing.assert_close(compiled, eager)
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    # The eager model kept its own layers; the decode forward shares their weights.
    assert not any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in model.modules())
    assert {p.data_ptr() for p in decode.parameters()} == {p.data_ptr() for p in model.parameters()}


def test_the_layers_and_their_siblings_compile_but_not_the_embedding_or_head() -> None:
    model, _ = load_paged_model(
        ModelSource("tiny", None, LlamaConfig(**CONFIG)), torch.device("cpu"), torch.float32
    )
    compiled: list[torch.nn.Module] = []

    def wrap(module: torch.nn.Module) -> torch.nn.Module:
        compiled.append(module)
        return torch.nn.Sequential(module)  # a new module, as torch.compile's wrapper is

    compile_layers(model, wrap)
    inner = model.model
    assert compiled == [*inner.layers, inner.norm, inner.rotary_emb]
    compiled.clear()
    compile_layers(model, wrap, siblings=False)
    assert compiled == [*inner.layers]


def test_a_model_that_names_no_layer_class_is_compiled_whole() -> None:
    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

    model = Plain()
    compiled = []
    assert compile_layers(model, lambda m: compiled.append(m) or m) is model
    assert compiled == [model]
