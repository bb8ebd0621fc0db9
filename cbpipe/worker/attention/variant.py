"""What one layer's attention computes, read from the arguments transformers passes it.

transformers calls an attention function as ``fn(module, query, key, value, attention_mask,
**kwargs)``, and the keywords say how the layer's attention differs from plain causal softmax
attention: ``scaling`` (Gemma's ``query_pre_attn_scalar``, Granite's multiplier),
``sliding_window`` (a query at position ``p`` sees the keys at ``p - sliding_window < k <= p``,
as transformers' ``sliding_window_overlay`` masks them), ``softcap`` (Gemma 2: scores become
``softcap * tanh(scores / softcap)`` before the mask), ``s_aux`` or ``sinks`` (gpt-oss: one
learned logit per head that joins each row's softmax and carries no value), ``dropout``,
``is_causal`` and ``position_bias``; then whatever the model's forward passes on
(``position_ids``, ``use_cache``, ``output_router_logits``, ...).

Every keyword is either understood here or refused with ``UnsupportedAttention``: a variant
cbpipe does not compute must never be ignored. The probe at load (``probe.py``) calls
``read_call`` on every layer once, so a model is refused before it serves; the attention
function calls it again at every call, which costs a few dictionary look-ups per layer in
eager steps and nothing in replayed CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


class UnsupportedAttention(ValueError):
    """A layer's attention asks for something cbpipe does not compute."""


@dataclass(frozen=True, eq=False)
class AttentionVariant:
    """One layer's attention: causal softmax attention over the paged cache, plus these."""

    scaling: float
    sliding_window: int | None = None  # keys p - window < k <= p are visible from position p
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None  # [num_heads] logits in each row's softmax, no value

    def describe(self) -> str:
        parts = [f"scaling {self.scaling:.4g}"]
        if self.sliding_window is not None:
            parts.append(f"sliding window {self.sliding_window}")
        if self.softcap is not None:
            parts.append(f"soft-cap {self.softcap:g}")
        if self.sinks is not None:
            parts.append("sinks")
        return ", ".join(parts)


# Keywords that carry no attention semantics: positions are already in the rotated queries and
# keys; the rest are flags of the model's forward that it passes on to every layer.
_IGNORED = frozenset({"position_ids", "cache_position", "use_cache"})
_SINK_NAMES = ("s_aux", "sinks")


def read_call(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, tokens, head_dim]
    value: torch.Tensor,
    attention_mask: object,
    args: tuple[object, ...],
    kwargs: Mapping[str, object],
) -> AttentionVariant:
    """The variant one attention call asks for; raises ``UnsupportedAttention`` saying why not.

    Keywords not named here are accepted only when they are None or False (a feature turned
    off); any other value is refused, naming the keyword.
    """
    if args:
        raise UnsupportedAttention(f"{len(args)} positional arguments after the mask")
    if attention_mask is not None:
        raise UnsupportedAttention(
            "the model builds its own attention mask (for example ALiBi biases or a custom "
            "pattern), which paged attention would ignore"
        )
    _check_shapes(query, key, value)
    rest = dict(kwargs)
    scaling = rest.pop("scaling", None)
    dropout = rest.pop("dropout", 0.0)
    if dropout:
        raise UnsupportedAttention(f"attention dropout {dropout} (the model is in training mode)")
    causal = rest.pop("is_causal", None)
    if causal is None:
        causal = getattr(module, "is_causal", True)
    if not causal:
        raise UnsupportedAttention("bidirectional (non-causal) attention")
    if rest.pop("position_bias", None) is not None:
        raise UnsupportedAttention("an additive position bias (relative or ALiBi)")
    if rest.pop("output_attentions", False):
        raise UnsupportedAttention("output_attentions=True (attention weights are not returned)")
    window = rest.pop("sliding_window", None)
    softcap = rest.pop("softcap", None)
    sinks = None
    for name in _SINK_NAMES:
        given = rest.pop(name, None)
        if given is not None:
            sinks = _check_sinks(name, given, query.shape[1])
    for name in _IGNORED:
        rest.pop(name, None)
    unknown = sorted(name for name, v in rest.items() if v is not None and v is not False)
    if unknown:
        raise UnsupportedAttention(
            "keyword arguments cbpipe does not implement: "
            + ", ".join(f"{name}={_short(rest[name])}" for name in unknown)
        )
    return AttentionVariant(
        scaling=float(query.shape[-1] ** -0.5 if scaling is None else scaling),  # type: ignore[arg-type]
        sliding_window=_check_window(window),
        softcap=_check_softcap(softcap),
        sinks=sinks,
    )


def _check_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise UnsupportedAttention(
            f"query, key and value of shapes {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)} (expected [batch, heads, tokens, head_dim])"
        )
    if value.shape[-1] != key.shape[-1] or query.shape[-1] != key.shape[-1]:
        raise UnsupportedAttention(
            f"query, key and value head sizes {query.shape[-1]}, {key.shape[-1]}, "
            f"{value.shape[-1]} differ (multi-head latent attention is not implemented)"
        )
    if key.shape[1] != value.shape[1] or query.shape[1] % key.shape[1]:
        raise UnsupportedAttention(
            f"{query.shape[1]} query heads for {key.shape[1]} key and {value.shape[1]} value heads"
        )


def _check_window(window: object) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedAttention(f"sliding_window={window!r} (expected a positive integer)")
    return window


def _check_softcap(softcap: object) -> float | None:
    if softcap is None:
        return None
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or softcap <= 0:
        raise UnsupportedAttention(f"softcap={softcap!r} (expected a positive number)")
    return float(softcap)


def _check_sinks(name: str, sinks: object, num_heads: int) -> torch.Tensor:
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (num_heads,):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise UnsupportedAttention(f"{name} of shape {shape} (expected one logit per head)")
    return sinks


def _short(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
