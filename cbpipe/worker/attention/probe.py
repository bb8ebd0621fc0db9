"""The probe at load: run the real model on a few tokens and see how its attention is called.

A model cbpipe would serve wrongly must be refused before any request reaches it, and a list
of architecture names cannot say which those are (a new transformers release adds some and
changes others). So the worker runs the loaded model twice on a tiny packed input, with a
``ProbeStep`` bound in place of a paged step, and checks what a paged step relies on:

- every decoder layer calls the attention function exactly once per forward, with a distinct
  ``layer_idx`` (layers that compute attention their own way, like Falcon's or BLOOM's, call
  it never; recurrent or convolution layers of hybrid models have no attention call at all);
- every call's arguments are understood (``variant.read_call``: scaling, sliding window,
  soft-cap, sinks), with no mask of the model's own making;
- rows of different sequences, packed one after another with their own ``position_ids``,
  influence each other only through attention: the second sequence's logits are the same
  packed behind the first as alone. Token mixing outside attention (a convolution, a state
  space layer, positions counted from the packed index) fails that;
- the cache ``generate`` would build keeps every key a layer attends to. transformers' cache
  keeps only a window of keys for every layer when a configuration sets ``sliding_window``
  without ``layer_types``, whether or not the layer's attention windows; where it does not,
  ``generate`` attends to all keys in its prefill and to a window in its decode steps, which
  nothing paged attention computes reproduces past that window.

The probe's own attention is dense and exact (``attend_math`` over each packed sequence with
the call's variant), so the comparison tests the model, not a kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from cbpipe.models.support import UnsupportedModel, architecture_name
from cbpipe.worker.attention.binding import StepBinding
from cbpipe.worker.attention.torch_rows import attend_math
from cbpipe.worker.attention.variant import AttentionVariant, UnsupportedAttention

# Two packed sequences: the second one is compared against itself alone.
_FIRST_LEN, _SECOND_LEN = 5, 4
# Largest difference allowed between the second sequence's logits packed and alone, relative
# to their largest magnitude: matrix products of other shapes round differently, by about
# 1e-6 in float32 and 1e-2 in bfloat16 after many layers; rows that leak into each other
# differ by about the logits' own size.
_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
_TOLERANCE_16_BIT = 0.1

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerAttention:
    """One KV-cache layer as the probe saw it."""

    index: int  # the attention module's layer_idx: its KV cache layer
    variant: AttentionVariant
    num_heads: int
    num_kv_heads: int
    head_dim: int
    module: torch.nn.Module = field(compare=False, repr=False)  # holds the layer's cache


@dataclass
class ModelAttention:
    """A loaded model's paged attention: the layers the probe found, and the binding that
    routes each step to them."""

    binding: StepBinding
    layers: list[LayerAttention]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_heads(self) -> int:
        return self.layers[0].num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].head_dim

    @property
    def kv_group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct sliding windows of the layers (None: a layer without one)."""
        return tuple(sorted({layer.variant.sliding_window for layer in self.layers}, key=str))

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for layer in self.layers:
            kinds[layer.variant.describe()] = kinds.get(layer.variant.describe(), 0) + 1
        return "; ".join(f"{n} layers: {kind}" for kind, n in kinds.items())


@dataclass
class _Call:
    module: torch.nn.Module  # the layer's attention module
    variant: AttentionVariant
    shapes: tuple[tuple[int, ...], ...]

    @property
    def layer(self) -> int | None:
        """The module's ``layer_idx``: its KV cache layer."""
        return getattr(self.module, "layer_idx", None)


@dataclass
class ProbeStep:
    """The step bound during the probe: records every call and answers it densely (causal
    attention within each packed sequence, with the call's variant)."""

    query_start: list[int]  # packed sequence boundaries, [num_seqs + 1]
    calls: list[_Call] = field(default_factory=list)

    def attend(
        self,
        layer: torch.nn.Module,
        variant: AttentionVariant,
        query: torch.Tensor,  # [num_tokens, heads, head_dim]
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        shapes = (tuple(query.shape), tuple(key.shape), tuple(value.shape))
        self.calls.append(_Call(layer, variant, shapes))
        return dense_attention(query, key, value, self.query_start, variant)


def dense_attention(
    query: torch.Tensor,  # [num_tokens, heads, head_dim]
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor,
    query_start: list[int],
    variant: AttentionVariant,
) -> torch.Tensor:
    """Causal attention of each packed sequence to itself, with ``variant``: the reference."""
    heads, kv_heads = query.shape[1], key.shape[1]
    out = torch.empty_like(query)
    for start, end in zip(query_start[:-1], query_start[1:], strict=True):
        q = query[start:end].transpose(0, 1)  # [H, n, D]
        k = key[start:end].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        v = value[start:end].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        pos = torch.arange(end - start, device=query.device)
        visible = pos[None, :] <= pos[:, None]
        if variant.sliding_window is not None:
            visible = visible & (pos[None, :] > pos[:, None] - variant.sliding_window)
        sinks = None if variant.sinks is None else variant.sinks.view(heads, 1, 1)
        rows = attend_math(q, k, v, visible, variant.scaling, variant.softcap, sinks)
        out[start:end] = rows.transpose(0, 1)
    return out


def probe_model(
    model: PreTrainedModel, binding: StepBinding, max_model_len: int | None = None
) -> ModelAttention:
    """Check that paged attention serves ``model`` exactly, for sequences of up to
    ``max_model_len`` tokens (default: the model's ``max_position_embeddings``); raises
    ``UnsupportedModel``.

    ``model`` was loaded with ``binding``'s ``attn_implementation``.
    """
    config = model.config
    arch = architecture_name(config)
    text = config.get_text_config()
    num_layers = int(text.num_hidden_layers)
    device = next(model.parameters()).device
    vocab = int(text.vocab_size)
    ids = torch.arange(_FIRST_LEN + _SECOND_LEN, device=device) * 7 % max(1, vocab - 1) + 1
    positions = torch.cat(
        [torch.arange(_FIRST_LEN, device=device), torch.arange(_SECOND_LEN, device=device)]
    )
    packed = ProbeStep([0, _FIRST_LEN, _FIRST_LEN + _SECOND_LEN])
    try:
        logits = _forward(model, binding, packed, ids, positions)
    except UnsupportedAttention as exc:
        raise UnsupportedModel(arch, [f"its attention: {exc}"]) from None
    except Exception as exc:  # noqa: BLE001 - whatever the model's own code raises
        raise UnsupportedModel(
            arch,
            [
                "its forward failed on two sequences packed as paged attention packs them "
                f"({type(exc).__name__}: {exc})"
            ],
        ) from exc
    layers = _layers(arch, packed.calls, num_layers)
    if max_model_len is None:
        max_model_len = getattr(text, "max_position_embeddings", None)
    _check_cache_windows(arch, text, layers, max_model_len)
    alone = ProbeStep([0, _SECOND_LEN])
    logits_alone = _forward(model, binding, alone, ids[_FIRST_LEN:], positions[_FIRST_LEN:])
    dtype = next(model.parameters()).dtype
    _check_independent(
        arch, logits[_FIRST_LEN:], logits_alone, _TOLERANCE.get(dtype, _TOLERANCE_16_BIT)
    )
    return ModelAttention(binding, layers)


def _forward(
    model: PreTrainedModel,
    binding: StepBinding,
    probe: ProbeStep,
    ids: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    with torch.inference_mode(), binding.bind(probe):
        out = model(input_ids=ids[None], position_ids=positions[None], use_cache=False)
    return out.logits[0].float()


def _layers(arch: str, calls: list[_Call], num_layers: int) -> list[LayerAttention]:
    if not calls:
        raise UnsupportedModel(
            arch,
            [
                "its layers compute attention without calling transformers' AttentionInterface, "
                "so the paged KV cache would be bypassed"
            ],
        )
    indices = [c.layer for c in calls]
    if sorted(indices) != list(range(num_layers)):  # type: ignore[type-var]
        raise UnsupportedModel(
            arch,
            [
                f"a forward of its {num_layers} decoder layers made {len(calls)} attention "
                f"calls with layer_idx {indices}; cbpipe needs one call per layer, each with "
                "its own layer_idx (layers without attention, such as recurrent, state-space "
                "or convolution layers, keep state the paged cache does not hold)"
            ],
        )
    layers = []
    for call in sorted(calls, key=lambda c: c.layer):  # type: ignore[arg-type, return-value]
        (_, heads, head_dim), (_, kv_heads, _), _ = call.shapes
        index = call.layer
        assert index is not None
        layers.append(LayerAttention(index, call.variant, heads, kv_heads, head_dim, call.module))
    shapes = {(la.num_heads, la.num_kv_heads, la.head_dim) for la in layers}
    if len(shapes) > 1:
        raise UnsupportedModel(
            arch, [f"its layers differ in (heads, KV heads, head size): {sorted(shapes)}"]
        )
    return layers


def _check_cache_windows(
    arch: str,
    text_config: PretrainedConfig,
    layers: list[LayerAttention],
    max_model_len: int | None,
) -> None:
    """Refuse a model whose ``generate`` would keep fewer keys than its attention reads,
    within ``max_model_len`` tokens (the cache's window: see the module's docstring)."""
    try:
        cache_layers = DynamicCache(config=text_config).layers
    except Exception as exc:  # noqa: BLE001 - a configuration the cache cannot read
        log.debug("%s: no cache layout to compare with (%s)", arch, exc)
        return
    cut: dict[int, list[int]] = {}  # window -> layers whose attention does not apply it
    for layer in layers:
        if layer.index >= len(cache_layers):
            continue
        window = getattr(cache_layers[layer.index], "sliding_window", None)
        attends = layer.variant.sliding_window  # None: every key
        if window is None or (attends is not None and attends <= window):
            continue  # the cache keeps every key the layer reads
        if max_model_len is None or window < max_model_len:
            cut.setdefault(window, []).append(layer.index)
    if cut:
        window = min(cut)
        raise UnsupportedModel(
            arch,
            [
                f"its configuration sets sliding_window {window}, so transformers' cache keeps "
                f"only the last {window} keys of layers {cut[window]}, which attend to every "
                "key: generate would read all keys in its prefill and a window in its decode "
                f"steps. Serve it with --max-model-len {window} or less, or remove "
                "sliding_window from its config.json if the model never used it"
            ],
        )


def _check_independent(
    arch: str, packed: torch.Tensor, alone: torch.Tensor, tolerance: float
) -> None:
    scale = alone.abs().max().item()
    diff = (packed - alone).abs().max().item()
    if not diff <= tolerance * max(scale, 1e-6):
        raise UnsupportedModel(
            arch,
            [
                "a sequence's logits change when another sequence is packed before it "
                f"(largest difference {diff:.3g} against logits up to {scale:.3g}): the model "
                "mixes tokens outside attention, or does not take positions from position_ids"
            ],
        )
