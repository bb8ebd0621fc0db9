"""Paged prefill attention: packed variable-length query chunks against the paged KV cache.

What: each sequence of a step brings ``q_len`` new query rows (a prefill chunk), packed one
after another as ``query[query_start[s] : query_start[s + 1]]``. Its keys and values, this
chunk's included, are already in the paged cache (``[num_slots, num_kv_heads, head_dim]``,
slot ``block_id * block_size + offset``, as in ``cbpipe.worker.attention``). The rows are the
sequence's last ``q_len`` positions: row ``j`` sits at ``p = context_len - q_len + j`` and
attends causally to keys ``0 .. p`` of its own sequence (chunked prefill: earlier chunks'
keys come from the cache).

Why: the torch path (``PagedStep.build`` + ``attend_gathered``) builds a dense boolean mask
``[P, 1, G * max_q, max_k]`` once per step, and in every layer copies every key and value of
every prefill sequence into ``[P, max_k]`` tensors, pads the query rows to ``[P, max_q]``
and calls SDPA with that mask. With an explicit mask SDPA cannot use its flash kernel; the
kernels that accept one read the whole mask and compute the masked half of the causal
square too. This kernel reads the pages in place through the block table, reads no mask,
skips key tiles no row of a query tile can see and masks only the tiles on the diagonal.

Design (flash-attention forward, varlen and paged):

* Grid ``(cdiv(max_query_len, BLOCK_ROWS), num_seqs, num_kv_heads)``, all from host integers,
  so a call never synchronises (and could be captured in a CUDA graph). A program whose
  first row is past its sequence's ``q_len`` exits at once. Row tiles are visited last
  first, so the programs with the most keys start first and the short ones fill in the tail.
* One program handles ``BLOCK_ROWS`` query rows of one sequence for all ``G`` query heads of
  one KV head (grouped-query attention): the (row, head-in-group) pairs are flattened into
  the ``M = BLOCK_ROWS * BLOCK_G`` rows of ``tl.dot`` (``BLOCK_G`` = ``G`` rounded up to a
  power of two; padded heads are masked), so each key and value tile is loaded once for the
  ``G`` heads instead of ``G`` times.
* Keys are visited in tiles of ``BLOCK_N`` positions, independent of the page size; each
  key's slot is looked up in the block table, as in the decode kernel. Tiles wholly below
  the tile's first row position need no mask at all; the remaining tiles, up to the last
  row's position, apply the causal mask. Nothing past the last row's position is read.
* Softmax runs in float32 in the base-2 domain with the usual online rescaling.
* A layer's sliding window (``tiles.py``): a row tile starts at the key tile holding its first
  row's window start, masks up to the first whole tile every row of the tile sees, and
  skips the masks from there to the causal tiles; keys before the window are never read.

Launch defaults (untuned: not yet measured on any GPU): ``M`` targets 128 (for ``G = 4``,
32 query rows; for ``G = 8``, 16), capped so the query tile stays within ``_Q_TILE_BYTES``
(32 KB: 128 x 128 in bf16) and shrunk to the longest chunk for short ones (but kept >= 16,
which ``tl.dot`` needs). ``BLOCK_N`` is 128 for head_dim 64 and 64 for head_dim 128 in
bf16 (a K or V tile of 16 KB), so two pipeline stages of K and V take 64 KB of shared
memory, far below the 228 KB of an H100/H200 SM. Eight warps for ``M = 128`` keep the
float32 accumulator (``M x head_dim``) and scores (``M x BLOCK_N``) at 32-64 registers per
thread each, where four warps would spill. ``BLOCK_ROWS`` follows the longest chunk (a
power of two), so a handful of variants compile, each once.

Only long-stable ``tl`` operations are used (masked loads and stores, ``tl.dot``,
``tl.exp2``, ``tl.where``), so the kernel should compile with the Triton of torch 2.11
(3.5/3.6) through 3.9, and it runs under Triton's CPU interpreter (``TRITON_INTERPRET=1``
before this module is imported), which is how the unit tests check it without a GPU.

Status: the plain causal kernel is measured on an H200 (3.6-4.8x gather + SDPA,
docs/PERFORMANCE.md) and serves prefill rows on CUDA (``attention/triton_rows.py``). The
sliding-window, soft-cap and sink variants have been checked against
``paged_prefill_reference`` under the CPU interpreter only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbpipe.worker.kernels.checks import (
    check_query_and_caches,
    check_variant,
    output_for,
    reference_scores,
)
from cbpipe.worker.kernels.jit import jit_varying
from cbpipe.worker.kernels.tiles import attend_tiles

_LOG2E = 1.4426950408889634
_MIN_DOT_ROWS = 16  # tl.dot needs M >= 16
# Untuned launch defaults for H100/H200 (see the module docstring); scripts/bench_attention.py
# --prefill-sweep times alternatives through the keyword arguments.
_MAX_BLOCK_M = 128  # (row, head) pairs per program
_Q_TILE_BYTES = 32 * 1024
_MAX_BLOCK_N = 128
_KV_TILE_BYTES = 16 * 1024
_NUM_STAGES = 2


# The table's row stride is the step's block-table width, and the metadata pointers start
# past the step's decode rows: both change from step to step.
@jit_varying("tables_ptr", "query_start_ptr", "context_lens_ptr", "stride_table")
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    query_start_ptr,
    context_lens_ptr,
    sinks_ptr,
    out_ptr,
    stride_q_row,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_o_row,
    stride_o_head,
    stride_table,
    qk_scale,
    softcap,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # Last row tile first: it has the most keys to visit.
    row_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    io_dtype = q_ptr.dtype.element_ty

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    first_row = row_tile * BLOCK_ROWS
    if first_row >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    # M index i is (row first_row + i // BLOCK_G, query head kv_head * GROUP + i % BLOCK_G).
    offs = tl.arange(0, BLOCK_M)
    rows = first_row + offs // BLOCK_G
    in_group = offs % BLOCK_G
    heads = kv_head * GROUP + in_group
    m_ok = (rows < q_len) & (in_group < GROUP)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    row_pos = context_len - q_len + rows

    # int64 row offsets: rows * stride overflows int32 on long packed steps of wide models.
    packed_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr
        + packed_rows[:, None] * stride_q_row
        + heads[:, None] * stride_q_head
        + dims[None, :],
        mask=m_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if INTERPRETED:
        # Triton's interpreter multiplies bf16 tiles as their raw uint16 bits; there the dots
        # run on float32 copies of the (already 16-bit) values instead.
        q = q.to(tl.float32)

    first_pos = context_len - q_len + first_row
    last_row = tl.minimum(first_row + BLOCK_ROWS, q_len) - 1
    end = context_len - q_len + last_row + 1  # keys past the tile's last row: never visible
    # Whole tiles at or below first_pos are visible to every row of the tile, unmasked; the
    # first causal tile starts at full_end <= first_pos, so every row sees its first key.
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N

    table = tables_ptr + seq.to(tl.int64) * stride_table
    k_head = k_ptr + kv_head * stride_k_head
    v_head = v_ptr + kv_head * stride_v_head
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # each row's sink, as one more key seen with no value
        sink = tl.load(sinks_ptr + heads, mask=in_group < GROUP, other=0.0)
        m_i = sink.to(tl.float32) * 1.4426950408889634  # log2(e)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_start = 0
    if WINDOW > 0:
        # Row r sees keys row_pos[r] - WINDOW < k <= row_pos[r]. Keys from the tile's first
        # row's window start up to the first whole tile every row sees take the masks; whole
        # tiles every row sees (from the last row's window start to the first row) none.
        window_tile = tl.maximum(first_pos - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        full_start = tl.cdiv(tl.maximum(end - WINDOW, 0), BLOCK_N) * BLOCK_N
        full_start = tl.minimum(tl.maximum(full_start, window_tile), full_end)
        m_i, l_i, acc = attend_tiles(
            q, m_i, l_i, acc, window_tile, full_start, end, row_pos, table, k_head, v_head,
            stride_k_slot, stride_v_slot, qk_scale, softcap, dims, dim_ok, io_dtype,
            BLOCK_SIZE, BLOCK_N, True, True, WINDOW, SOFTCAP, INTERPRETED,
        )  # fmt: skip
    # Whole tiles first, every key visible to every row; then the causal ones.
    m_i, l_i, acc = attend_tiles(
        q, m_i, l_i, acc, full_start, full_end, end, row_pos, table, k_head, v_head,
        stride_k_slot, stride_v_slot, qk_scale, softcap, dims, dim_ok, io_dtype, BLOCK_SIZE,
        BLOCK_N, False, False, 0, SOFTCAP, INTERPRETED,
    )  # fmt: skip
    m_i, l_i, acc = attend_tiles(
        q, m_i, l_i, acc, full_end, end, end, row_pos, table, k_head, v_head, stride_k_slot,
        stride_v_slot, qk_scale, softcap, dims, dim_ok, io_dtype, BLOCK_SIZE, BLOCK_N, True,
        True, WINDOW, SOFTCAP, INTERPRETED,
    )  # fmt: skip

    # l_i >= 1 on every valid row (it sees at least its own key); the guard only keeps a
    # caller's context_len < q_len from dividing by zero.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr
        + packed_rows[:, None] * stride_o_row
        + heads[:, None] * stride_o_head
        + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & dim_ok[None, :],
    )


# The decorators above return interpreter objects when TRITON_INTERPRET=1 was set at import.
_INTERPRETED = not isinstance(_prefill_kernel, triton.runtime.jit.JITFunction)


def _prev_power_of_2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def launch_config(
    group: int,
    head_dim: int,
    itemsize: int,
    max_query_len: int,
    *,
    block_rows: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> dict[str, int]:
    """Tile sizes and warps for a launch, from host integers only (see the module docstring).

    Returns ``BLOCK_G``, ``BLOCK_ROWS``, ``BLOCK_M`` (= rows x BLOCK_G), ``BLOCK_D``,
    ``BLOCK_N`` and ``num_warps``. Given values override the defaults; powers of two only.
    """
    block_g = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_rows is None:
        target_m = _prev_power_of_2(_Q_TILE_BYTES // (block_d * itemsize))
        target_m = min(_MAX_BLOCK_M, max(_MIN_DOT_ROWS, target_m))
        block_rows = max(1, target_m // block_g)
        # Short chunks get short tiles rather than mostly idle rows.
        block_rows = min(block_rows, triton.next_power_of_2(max(1, max_query_len)))
        block_rows = max(block_rows, triton.cdiv(_MIN_DOT_ROWS, block_g))
    if block_n is None:
        block_n = _prev_power_of_2(_KV_TILE_BYTES // (block_d * itemsize))
        block_n = min(_MAX_BLOCK_N, max(16, block_n))
    for name, value in (("block_rows", block_rows), ("block_n", block_n)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if block_n < 16:
        raise ValueError(f"block_n must be at least 16 (tl.dot), got {block_n}")
    block_m = block_rows * block_g
    if block_m < _MIN_DOT_ROWS:
        raise ValueError(f"block_rows {block_rows} x {block_g} heads is under 16 rows (tl.dot)")
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    return {
        "BLOCK_G": block_g,
        "BLOCK_ROWS": block_rows,
        "BLOCK_M": block_m,
        "BLOCK_D": block_d,
        "BLOCK_N": block_n,
        "num_warps": num_warps,
    }


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_rows: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's packed query rows to its cached keys and values.

    Args:
        query: ``[num_rows, num_heads, head_dim]``, bf16, fp16 or fp32, head_dim contiguous
            (other strides are free). Sequence ``s`` owns rows
            ``query_start[s] .. query_start[s + 1] - 1``: its last ``q_len`` positions.
        key_cache: ``[num_slots, num_kv_heads, head_dim]``, slot ``block * block_size + i``;
            the last dimension contiguous. Loaded values are cast to the query's dtype.
        value_cache: like ``key_cache``.
        block_tables: int32 ``[num_seqs, width]``, the last dimension contiguous.
        query_start: integer ``[num_seqs + 1]``, non-decreasing; an empty sequence is allowed.
        context_lens: integer ``[num_seqs]``: keys ``0 .. context_len - 1`` are in the cache,
            this chunk's included. The caller keeps ``q_len <= context_len <= width *
            block_size`` and ``q_len <= max_query_len``; nothing checks them on the device.
        block_size: tokens per cache block.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        max_query_len: a host bound on every ``q_len``; sizes the grid.
        sliding_window: if set, a row at position ``p`` sees only the keys
            ``p - sliding_window < k <= p``; each window compiles a variant of its own.
        softcap: if set, scores become ``softcap * tanh(scores / softcap)``.
        sinks: ``[num_heads]`` logits, one per head, that join each row's softmax with no
            value (gpt-oss); any float dtype.
        out: optional ``[num_rows, num_heads, head_dim]`` of the query's dtype, head_dim
            contiguous. Rows no sequence owns are left as they are (uninitialised if
            allocated here).
        block_rows, block_n, num_warps, num_stages: launch overrides for tuning (powers of
            two for the blocks); None takes ``launch_config``'s untuned defaults.

    Returns:
        ``out`` (allocated if not given).
    """
    check_query_and_caches(query, key_cache, value_cache, (block_tables, query_start, context_lens))
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError("block_tables must be a 2-D int32 tensor")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables' rows must be contiguous")
    num_seqs = block_tables.shape[0]
    if query_start.shape != (num_seqs + 1,) or query_start.is_floating_point():
        raise ValueError(f"query_start {tuple(query_start.shape)} != ({num_seqs + 1},), integer")
    if context_lens.shape != (num_seqs,) or context_lens.is_floating_point():
        raise ValueError(f"context_lens {tuple(context_lens.shape)} != ({num_seqs},), integer")
    out = output_for(query, out)
    if query.stride(2) != 1:
        query = query.contiguous()
    check_variant(sliding_window, softcap, sinks, num_heads, query.device)
    if num_seqs == 0 or max_query_len <= 0 or query.shape[0] == 0:
        return out

    group = num_heads // num_kv_heads
    itemsize = max(query.element_size(), key_cache.element_size())
    config = launch_config(
        group,
        head_dim,
        itemsize,
        max_query_len,
        block_rows=block_rows,
        block_n=block_n,
        num_warps=num_warps,
    )
    grid = (triton.cdiv(max_query_len, config["BLOCK_ROWS"]), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start,
        context_lens,
        query if sinks is None else sinks,  # never read without sinks
        out,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        scale * _LOG2E,
        (softcap or 0.0) * _LOG2E,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        WINDOW=sliding_window or 0,
        SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        INTERPRETED=_INTERPRETED,
        num_stages=_NUM_STAGES if num_stages is None else num_stages,
        **config,
    )
    return out


def paged_prefill_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ground truth for ``paged_prefill_attention``: a plain loop, float32 math.

    Reads device values on the host, so it syncs. Returns float32; rows no sequence owns are
    zeros. Raises if a chunk is longer than ``max_query_len`` or than its context.
    """
    num_rows, num_heads, head_dim = query.shape
    group = num_heads // key_cache.shape[1]
    tables = block_tables.long()
    starts = query_start.tolist()
    lens = context_lens.tolist()
    out = torch.zeros(num_rows, num_heads, head_dim, dtype=torch.float32, device=query.device)
    for s, n in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if not 0 <= q_len <= min(n, max_query_len):
            raise ValueError(f"sequence {s}: q_len {q_len}, context {n}, max {max_query_len}")
        if q_len == 0:
            continue
        pos = torch.arange(n, device=query.device)
        slots = tables[s, pos // block_size] * block_size + pos % block_size
        k = key_cache[slots].float().repeat_interleave(group, dim=1)  # [n, heads, head_dim]
        v = value_cache[slots].float().repeat_interleave(group, dim=1)
        q = query[starts[s] : starts[s + 1]].float()  # [q_len, heads, head_dim]
        scores = torch.einsum("qhd,nhd->hqn", q, k) * scale
        row_pos = n - q_len + torch.arange(q_len, device=query.device)
        visible = pos[None, :] <= row_pos[:, None]  # [q_len, n]
        if sliding_window is not None:
            visible = visible & (pos[None, :] > row_pos[:, None] - sliding_window)
        weights = reference_scores(scores, visible, softcap, sinks)
        out[starts[s] : starts[s + 1]] = torch.einsum("hqn,nhd->qhd", weights, v)
    return out
