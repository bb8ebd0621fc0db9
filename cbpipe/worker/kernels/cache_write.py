"""Writing a step's new keys and values into the paged cache, in one Triton kernel.

Each row of the step owns one cache slot (``slot_mapping``); its keys and values, ``[rows,
kv_heads, head_dim]`` views of whatever the model produced (strided, not copied), land at
that slot of the ``[num_slots, kv_heads, head_dim]`` caches. One program per row stores
both.

Why not index assignment in the traced model, which inductor fuses into the kernel that
applies the rotary embedding to the keys: that fused kernel scatters into the cache, and
inductor picks its tiles by timing the candidates on the first call, with the cache (a
mutated argument, gigabytes a layer in a server) cloned for every candidate and every row
writing the cache's padding slot. On the H200 its pick differed from run to run, and the
slower pick took nearly three times as long, several percent of an 8B step
(docs/PERFORMANCE.md). Our own kernel takes that choice away: the keys' rotary embedding
stays an element-wise kernel of inductor's, with nothing mutated, and the writes are this
one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbpipe.worker.kernels.jit import jit_varying


# The new rows are views into buffers whose offsets and strides follow the step's row count
# in eager steps; specialising on them would compile new variants while a server runs.
@jit_varying(
    "key_ptr",
    "value_ptr",
    "slot_ptr",
    "key_row_stride",
    "key_head_stride",
    "value_row_stride",
    "value_head_stride",
)
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    key_row_stride,
    key_head_stride,
    value_row_stride,
    value_head_stride,
    key_cache_slot_stride,
    key_cache_head_stride,
    value_cache_slot_stride,
    value_cache_head_stride,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    DIM_PADDED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)  # slot * stride passes 2**31 in a large cache
    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, DIM_PADDED)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    key = tl.load(key_ptr + row * key_row_stride + heads * key_head_stride + dims, mask=mask)
    tl.store(
        key_cache_ptr + slot * key_cache_slot_stride + heads * key_cache_head_stride + dims,
        key,
        mask=mask,
    )
    value = tl.load(
        value_ptr + row * value_row_stride + heads * value_head_stride + dims, mask=mask
    )
    tl.store(
        value_cache_ptr + slot * value_cache_slot_stride + heads * value_cache_head_stride + dims,
        value,
        mask=mask,
    )


def write_kv_cache(
    key: torch.Tensor,  # [rows, kv_heads, head_dim], head_dim contiguous
    value: torch.Tensor,  # [rows, kv_heads, head_dim], head_dim contiguous
    key_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [rows] integer slots
) -> None:
    """Store row ``i`` of ``key`` and ``value`` at slot ``slot_mapping[i]`` of the caches.

    Rows that share a slot (padding rows) leave one of theirs there. No host synchronisation:
    the launch depends on shapes only, so it can be captured in a CUDA graph.
    """
    rows, num_heads, head_dim = key.shape
    if value.shape != key.shape or slot_mapping.shape != (rows,):
        raise ValueError(
            f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} must agree on rows, heads and head_dim"
        )
    if key_cache.shape[1:] != key.shape[1:] or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"caches {tuple(key_cache.shape)} and {tuple(value_cache.shape)} do not hold "
            f"rows of {num_heads} heads of {head_dim}"
        )
    if not key.dtype == value.dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(
            f"rows of {key.dtype} and {value.dtype} for caches of {key_cache.dtype} and "
            f"{value_cache.dtype}: the dtypes must be the same"
        )
    if any(t.stride(-1) != 1 for t in (key, value, key_cache, value_cache)):
        raise ValueError("head_dim must be contiguous in the rows and the caches")
    if rows == 0:
        return
    _write_kv_kernel[(rows,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEADS_PADDED=triton.next_power_of_2(num_heads),
        DIM_PADDED=triton.next_power_of_2(head_dim),
    )
