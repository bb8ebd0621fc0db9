"""Host-side checks shared by the paged attention kernels' wrappers (no device reads)."""

from __future__ import annotations

import torch


def check_query_and_caches(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: tuple[torch.Tensor, ...],
) -> None:
    """``query`` ``[rows, heads, head_dim]`` against caches ``[slots, kv_heads, head_dim]``."""
    if query.dim() != 3 or key_cache.dim() != 3 or key_cache.shape[2] != query.shape[2]:
        raise ValueError(f"query {tuple(query.shape)} and key_cache {tuple(key_cache.shape)}")
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[1]
    if any(t.device != query.device for t in (key_cache, value_cache, *metadata)):
        raise ValueError("all tensors must be on the query's device")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache {value_cache.shape} differs from key_cache")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if key_cache.stride(2) != 1 or value_cache.stride(2) != 1:
        raise ValueError("the caches' head_dim must be contiguous")


def output_for(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` if it fits the query, else a new tensor of the query's shape and dtype."""
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError("out must match the query's shape and dtype, head_dim contiguous")
    return out


def check_variant(
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    num_heads: int,
    device: torch.device,
) -> None:
    """A layer's attention variant, as the kernels take it."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if sinks is not None:
        if sinks.shape != (num_heads,) or not sinks.is_floating_point():
            raise ValueError(f"sinks must be [{num_heads}] floats, got {tuple(sinks.shape)}")
        if sinks.device != device or sinks.stride(0) != 1:
            raise ValueError("sinks must be contiguous, on the query's device")


def reference_scores(
    scores: torch.Tensor,  # [heads, rows..., keys] float32, scaled
    visible: torch.Tensor,  # broadcast to scores: True where a key is seen
    softcap: float | None,
    sinks: torch.Tensor | None,  # [heads]
) -> torch.Tensor:
    """The references' softmax weights: soft-cap, mask, then softmax with the head's sink
    logit as one more entry, whose weight is dropped. Rows that see nothing get zeros."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(-1, *([1] * (scores.dim() - 1))).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights[..., :-1] if sinks is not None else weights
