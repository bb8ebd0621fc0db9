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
