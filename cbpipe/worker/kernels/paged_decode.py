"""Paged decode attention: one query token per sequence against its paged KV cache, in Triton.

Layout (as in ``cbpipe.worker.attention``): the caches are ``[num_slots, num_kv_heads,
head_dim]`` with slot ``block_id * block_size + offset``; the block tables are one flat int32
buffer where sequence ``s`` owns ``block_tables[s * width : (s + 1) * width]``, and ``width``
is read from a one-element device tensor inside the kernel, like the context lengths. Nothing
about the launch depends on a device value: grids, scratch shapes and the number of splits
come from host integers, so a call never synchronises and can be captured in a CUDA graph
once and replayed with new lengths, tables and widths written in place.

Design:

* One program per (sequence, KV head, split) handles all ``G`` query heads that share the KV
  head (grouped-query attention), so each key and value is read from memory once per split,
  not ``G`` times. The ``G`` rows are padded to 16 (masked) because ``tl.dot`` needs at least
  16 rows; decode is bound by memory, so the idle rows of the tensor-core tile cost nothing.
  (With small heads a program takes several KV heads at once: the packing below.)
* Keys are visited in tiles of ``BLOCK_N`` tokens, independent of the page size: each token's
  slot is looked up in the block table, so any block size works with the same tile.
* Split-KV (flash-decoding): each program walks its keys serially, and there are only
  ``num_seqs * num_kv_heads`` (sequence, KV head) pairs. With fewer pairs than SMs, say batch
  4 with 8 KV heads (32 pairs) on the 132 SMs of an H100/H200, most of the GPU idles through a
  long context. Splitting each sequence's keys into ``num_splits`` contiguous ranges multiplies
  the programs; each writes a partial softmax state (running max, sum and unnormalised output,
  float32) and a second small kernel merges the splits. The ranges are computed in the kernel
  from the loaded context length, so splits past the end of a short sequence are empty: they
  write an empty state that the merge gives zero weight. With one split the first kernel
  writes the output itself and the merge is skipped. Measured on an H200 (bf16, head_dim 128,
  8 KV heads, 8192 tokens): batch 4 took 157 us with one split and 49 us with eight; at batch
  32 (256 pairs, about two per SM) one split was already the fastest, at about 4.1 TB/s, with
  128-token tiles and two pipeline stages keeping enough loads in flight. Hence the default:
  split only when the pairs do not cover the SMs.
* Small heads are packed (``heads_per_program``): with head_dim 64 a (token, KV head) row of
  the cache is 128 bytes, and a program per KV head gathers the cache in rows that short. A
  program instead takes ``P`` adjacent KV heads, whose rows lie side by side in a slot, and
  treats them as one head of ``P * head_dim``: its query tile holds the ``P * G`` query
  heads, each row zero outside its own head's dims, so a row's scores against the packed
  keys are its own head's scores, and of the packed output row only its own head's dims are
  stored. The products do ``P`` times the work of the rows that count, on tensor-core tiles
  that were mostly padding anyway; the loads are ``P`` times longer and ``P`` times fewer.
* Softmax runs in float32 in the base-2 domain (the scale is multiplied by log2(e) once), the
  usual online-softmax rescaling across tiles.
* The rows' own keys and values (``NewRows``): a decode step's layer stores them in the
  same launch instead of a kernel of its own before it. The program whose split holds a
  row's last position attends that key and value from registers after the cached ones, and
  then stores them; no other program reads that slot, so nothing waits for the store.
* A layer's variant (``tiles.py``): with a sliding window the splits divide the keys from
  the tile holding ``context_len - window`` on, so keys before the window are never read;
  a soft-cap bends the scores; sinks start the first split's state at (sink, 1), and the
  merge weighs them like any split. These variants have run under the interpreter only.

Only long-stable ``tl`` operations are used (masked loads and stores, ``tl.dot``, ``tl.exp2``),
so the kernels compile with the Triton of torch 2.11 through Triton 3.9, and run under
Triton's CPU interpreter (``TRITON_INTERPRET=1`` before this module is imported).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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
from cbpipe.worker.kernels.tiles import attend_key, attend_tiles

_LOG2E = 1.4426950408889634
_MIN_DOT_ROWS = 16  # tl.dot needs M >= 16
_MAX_SPLITS = 64  # a power of two: the merge kernel's one padded width
# Launch settings, tuned on an H200 with ``scripts/bench_attention.py --sweep`` (which
# overrides these module attributes). A K or V tile holds at most _TILE_BYTES: with two of
# them per stage, two stages stay well inside the 228 KB of shared memory of an SM, so
# float32 or head_dim 256 get shorter tiles rather than a launch that fails for lack of it.
_MAX_BLOCK_N = 128
_TILE_BYTES = 32 * 1024
_NUM_WARPS = 4
_NUM_STAGES = 2
# Programs per SM that a split launch aims for, when the unsplit pairs are fewer than the SMs.
_SPLIT_PROGRAMS_PER_SM = 2
# KV heads a program takes by default: adjacent heads until they span this many dims.
_PACKED_HEAD_DIM = 128


class NewRows(NamedTuple):
    """Each sequence's own key and value, which the kernel attends and then stores.

    ``keys`` and ``values`` are ``[num_seqs, num_kv_heads, head_dim]`` of the caches' dtype
    (any strides, head_dim contiguous); ``slots[s]`` is the cache slot of sequence ``s``'s
    position ``context_len - 1``, the one its block table maps that position to. Storing them
    in the attention kernel spares a decode step one launch per layer.
    """

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor  # [num_seqs] integer


# The split count follows the batch size; specialising on it would compile variants mid-run.
# The metadata pointers are left general as the prefill kernel's are, though decode rows start
# each step at the slot's first row, so their alignment never changes; whether specialising
# them would speed the kernel up is not measured.
# The new rows (``NewRows``) are views of the model's own outputs, whose strides follow the
# batch size; like the cache writer's rows they are left general.
@jit_varying(
    "tables_ptr",
    "width_ptr",
    "context_lens_ptr",
    "num_splits",
    "new_k_ptr",
    "new_v_ptr",
    "new_slots_ptr",
    "stride_nk_seq",
    "stride_nk_head",
    "stride_nv_seq",
    "stride_nv_head",
)
def _split_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    width_ptr,
    context_lens_ptr,
    sinks_ptr,
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    new_k_ptr,
    new_v_ptr,
    new_slots_ptr,
    stride_q_seq,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_o_seq,
    stride_o_head,
    stride_nk_seq,
    stride_nk_head,
    stride_nv_seq,
    stride_nv_head,
    num_heads,
    num_splits,
    qk_scale,
    softcap,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PACK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    WRITE_OUTPUT: tl.constexpr,
    STORE_NEW: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) * PACK  # the first of the program's PACK KV heads
    split = tl.program_id(2)
    io_dtype = q_ptr.dtype.element_ty

    # Rows: the PACK * GROUP query heads, which are consecutive. Dims: the PACK heads' dims
    # side by side (with PACK > 1 the host has checked that they are contiguous in a slot).
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, PACK * BLOCK_D)
    row_ok = rows < PACK * GROUP
    dim_ok = dims % BLOCK_D < HEAD_DIM
    heads = kv_head * GROUP + rows
    # A row's own head's dims: the only ones its query holds and its output keeps.
    own = (rows // GROUP)[:, None] == (dims // BLOCK_D)[None, :]
    head_dims = (dims % BLOCK_D)[None, :]
    row_mask = row_ok[:, None] & dim_ok[None, :] & own

    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + head_dims,
        mask=row_mask,
        other=0.0,
    )
    if INTERPRETED:
        # Triton's interpreter multiplies bf16 tiles as their raw uint16 bits; there the dots
        # run on float32 copies of the (already 16-bit) values instead.
        q = q.to(tl.float32)

    context_len = tl.load(context_lens_ptr + seq)
    width = tl.load(width_ptr)
    # The row sits at position context_len - 1; with a window it sees the last WINDOW keys.
    first_tile = 0
    if WINDOW > 0:
        first_tile = tl.maximum(context_len - WINDOW, 0) // BLOCK_N * BLOCK_N
    # Whole tiles per split, so only a split's last tile (and the sequence's) is ragged.
    per_split = tl.cdiv(tl.cdiv(context_len - first_tile, num_splits), BLOCK_N) * BLOCK_N
    start = first_tile + split * per_split
    end = tl.minimum(start + per_split, context_len)
    table = tables_ptr + seq.to(tl.int64) * width
    k_head = k_ptr + kv_head * stride_k_head
    v_head = v_ptr + kv_head * stride_v_head

    cache_end = end
    if STORE_NEW:
        # The row's own key and value: the program whose split holds the row's position
        # attends them from these registers, the cache's keys stopping short of them, and
        # stores them into the cache after its loop (no other program reads that slot). The
        # loads are issued here so that their latency hides behind the loop. A row with
        # context_len 0 (a batch's padding) attends and stores nothing.
        last = context_len - 1
        owns_last = (start <= last) & (last < end)
        cache_end = tl.where(owns_last, last, end)
        new_ok = tl.where(owns_last, dim_ok, False)
        new_heads = kv_head + dims // BLOCK_D
        new_dims = dims % BLOCK_D
        new_k = tl.load(
            new_k_ptr + seq * stride_nk_seq + new_heads * stride_nk_head + new_dims,
            mask=new_ok,
            other=0.0,
        )
        new_v = tl.load(
            new_v_ptr + seq * stride_nv_seq + new_heads * stride_nv_head + new_dims,
            mask=new_ok,
            other=0.0,
        )

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if HAS_SINKS:  # noqa: SIM102 (a constexpr branch around a run-time one)
        # The sink joins the softmax once per row: in the first split's state.
        if split == 0:
            m_i = (
                tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32)
                * 1.4426950408889634
            )
            l_i = tl.full([BLOCK_G], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, PACK * BLOCK_D], dtype=tl.float32)
    row_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (context_len - 1)  # for the window only
    # Keys masked at ``cache_end``, no causal mask.
    m_i, l_i, acc = attend_tiles(
        q, m_i, l_i, acc, start, cache_end, cache_end, row_pos, table, k_head, v_head,
        stride_k_slot, stride_v_slot, qk_scale, softcap, dims, dim_ok, io_dtype, BLOCK_SIZE,
        BLOCK_N, True, False, WINDOW, SOFTCAP, INTERPRETED,
    )  # fmt: skip
    if STORE_NEW:
        m_i, l_i, acc = attend_key(
            q, m_i, l_i, acc, new_k, new_v, owns_last, qk_scale, softcap, io_dtype, SOFTCAP
        )
        slot = tl.load(new_slots_ptr + seq).to(tl.int64)
        tl.store(k_head + slot * stride_k_slot + dims, new_k, mask=new_ok)
        tl.store(v_head + slot * stride_v_slot + dims, new_v, mask=new_ok)

    if WRITE_OUTPUT:
        # One split: an empty sequence leaves l_i = 0 and acc = 0: its output is zeros.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + head_dims,
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )
    else:
        part = (seq * num_heads + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        # A split that attended nothing (l_i 0: past a short context, most of a launch's
        # splits) keeps its zeros: the merge reads no state of a split whose sum is 0.
        tl.store(
            part_acc_ptr + part[:, None] * BLOCK_D + head_dims,
            acc,
            mask=row_ok[:, None] & own & (l_i > 0.0)[:, None],
        )


@jit_varying("num_splits")
def _merge_splits_kernel(
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    out_ptr,
    stride_o_seq,
    stride_o_head,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    part = (seq * num_heads + head) * num_splits + splits

    m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    # Empty splits have m = -inf; if all are empty, subtracting 0 instead of -inf keeps every
    # weight exp2(-inf) = 0 rather than NaN, and the output row is zeros.
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
    w = tl.exp2(m - m_max)
    total = tl.sum(w * sums, 0)
    attended = split_ok & (sums > 0.0)  # the splits that stored their state
    acc = tl.load(
        part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], mask=attended[:, None], other=0.0
    )
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


# The decorators above return interpreter objects when TRITON_INTERPRET=1 was set at import.
_INTERPRETED = not isinstance(_split_kv_kernel, triton.runtime.jit.JITFunction)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits_for(num_pairs: int, num_sms: int) -> int:
    """Splits per sequence for ``num_pairs`` (sequence, KV head) pairs on ``num_sms`` SMs.

    One split once the pairs cover the SMs (more only added merge work in measurements);
    otherwise enough splits for ``_SPLIT_PROGRAMS_PER_SM`` programs per SM. The context
    lengths are unknown here, so a short batch may get splits that turn out empty; those
    programs exit after writing an empty state, far cheaper than idle SMs on a long context.
    """
    if num_pairs >= num_sms:
        return 1
    return min(_MAX_SPLITS, triton.cdiv(_SPLIT_PROGRAMS_PER_SM * num_sms, max(1, num_pairs)))


def default_num_splits(num_seqs: int, programs_per_seq: int, device: torch.device) -> int:
    """Splits per sequence from host-known sizes only (never from device values).

    ``programs_per_seq``: the KV heads over the heads each program takes. Off CUDA (the
    interpreter) one SM is assumed, so that is always one split.
    """
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 1
    return num_splits_for(num_seqs * programs_per_seq, sms)


def _head_tile(head_dim: int) -> int:
    """The dims of one head's tile: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def packable_heads(
    head_dim: int, num_kv_heads: int, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> int:
    """The most KV heads one program may take: 1 unless their rows lie side by side.

    Packing needs each head's dims to fill their tile exactly (``_head_tile``) and the heads
    of a slot to follow one another in both caches; then any power of two dividing the KV
    heads.
    """
    contiguous = all(
        cache.stride(1) == head_dim and cache.stride(2) == 1 for cache in (key_cache, value_cache)
    )
    if head_dim != _head_tile(head_dim) or not contiguous:
        return 1
    return num_kv_heads & -num_kv_heads  # the largest power of two dividing it


def default_heads_per_program(head_dim: int, most: int) -> int:
    """Adjacent KV heads per program, up to ``most``: until they span ``_PACKED_HEAD_DIM``."""
    pack = 1
    while pack * head_dim < _PACKED_HEAD_DIM and pack * 2 <= most:
        pack *= 2
    return pack


def launch_grid(
    num_seqs: int,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    device: torch.device,
    heads_per_program: int | None = None,
    num_splits: int | None = None,
) -> tuple[int, int]:
    """The KV heads a program takes and the splits per sequence that a launch uses: the
    defaults where None, else the given ones checked against what the caches allow."""
    _, num_kv_heads, head_dim = key_cache.shape
    most = packable_heads(head_dim, num_kv_heads, key_cache, value_cache)
    if heads_per_program is None:
        heads_per_program = default_heads_per_program(head_dim, most)
    if heads_per_program < 1 or most % heads_per_program:
        raise ValueError(
            f"heads_per_program {heads_per_program} does not divide {most}, the most KV heads "
            f"these caches let one program take (head_dim {head_dim}, {num_kv_heads} KV heads)"
        )
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads // heads_per_program, device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be positive, got {num_splits}")
    return heads_per_program, num_splits


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    block_table_width: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    heads_per_program: int | None = None,
    out: torch.Tensor | None = None,
    new_rows: NewRows | None = None,
) -> torch.Tensor:
    """Attend each sequence's one query token to its cached keys and values.

    Args:
        query: ``[num_seqs, num_heads, head_dim]``, bf16, fp16 or fp32.
        key_cache: ``[num_slots, num_kv_heads, head_dim]``, slot ``block * block_size + i``;
            the last dimension contiguous. Loaded values are cast to the query's dtype.
        value_cache: like ``key_cache``.
        block_tables: flat contiguous int32; sequence ``s``'s block ids are
            ``block_tables[s * width : (s + 1) * width]``.
        block_table_width: one-element integer device tensor holding ``width``, read in the
            kernel (so a captured graph picks up a new width written in place).
        context_lens: ``[num_seqs]`` integer; keys ``0 .. context_len - 1`` are attended, and
            a 0 gives a zero output row. ``context_len <= width * block_size`` is the caller's
            to keep; nothing checks it on the device.
        block_size: tokens per cache block.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: if set, the row (at position ``context_len - 1``) sees only the last
            ``sliding_window`` keys; each window compiles a variant of its own.
        softcap: if set, scores become ``softcap * tanh(scores / softcap)``.
        sinks: ``[num_heads]`` logits, one per head, that join each row's softmax with no
            value (gpt-oss); any float dtype.
        num_splits: key ranges per sequence; None picks ``default_num_splits``
            (``launch_grid`` resolves both).
        heads_per_program: adjacent KV heads one program attends for (a power of two that
            divides the KV heads, >1 only where ``packable_heads`` allows it); None picks
            ``default_heads_per_program``.
        out: optional ``[num_seqs, num_heads, head_dim]`` output of the query's dtype.
        new_rows: each sequence's own key and value, not yet in the caches: attended, then
            stored at their slots (``NewRows``); None: they are in the caches already.

    Returns:
        ``out`` (allocated if not given).
    """
    check_query_and_caches(
        query, key_cache, value_cache, (block_tables, block_table_width, context_lens)
    )
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    if block_tables.dtype != torch.int32 or block_tables.dim() != 1:
        raise ValueError("block_tables must be a flat int32 tensor")
    if block_tables.stride(0) != 1:
        raise ValueError("block_tables must be contiguous")
    if block_table_width.numel() != 1:
        raise ValueError("block_table_width must hold exactly one element")
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"context_lens {tuple(context_lens.shape)} != ({num_seqs},)")
    out = output_for(query, out)
    if query.stride(2) != 1:
        query = query.contiguous()
    if new_rows is not None:
        _check_new_rows(new_rows, num_seqs, key_cache, value_cache)
    heads_per_program, num_splits = launch_grid(
        num_seqs, key_cache, value_cache, query.device, heads_per_program, num_splits
    )
    num_programs = num_kv_heads // heads_per_program
    check_variant(sliding_window, softcap, sinks, num_heads, query.device)
    if num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    block_g = max(_MIN_DOT_ROWS, triton.next_power_of_2(group * heads_per_program))
    block_d = _head_tile(head_dim)
    itemsize = max(query.element_size(), key_cache.element_size())
    block_n = max(16, min(_MAX_BLOCK_N, _TILE_BYTES // (heads_per_program * block_d * itemsize)))
    if num_splits == 1:
        # Never read: the split kernel writes the output directly.
        part_max = part_sum = part_acc = out
    else:
        part_max = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(
            (num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=query.device
        )

    _split_kv_kernel[(num_seqs, num_programs, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        block_table_width,
        context_lens,
        query if sinks is None else sinks,  # never read without sinks
        out,
        part_max,
        part_sum,
        part_acc,
        *(new_rows or (query, query, context_lens)),  # never read without new rows
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(1),
        out.stride(0),
        out.stride(1),
        *(new_rows.keys.stride()[:2] if new_rows else (0, 0)),
        *(new_rows.values.stride()[:2] if new_rows else (0, 0)),
        num_heads,
        num_splits,
        scale * _LOG2E,
        (softcap or 0.0) * _LOG2E,
        GROUP=group,
        BLOCK_G=block_g,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PACK=heads_per_program,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        WINDOW=sliding_window or 0,
        SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        WRITE_OUTPUT=num_splits == 1,
        STORE_NEW=new_rows is not None,
        INTERPRETED=_INTERPRETED,
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_max,
            part_sum,
            part_acc,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            # One variant for every split count of the default policy, so the split count,
            # which follows the batch size, never compiles a new merge kernel mid-run.
            SPLITS_PAD=max(_MAX_SPLITS, triton.next_power_of_2(num_splits)),
        )
    return out


def _check_new_rows(
    new_rows: NewRows, num_seqs: int, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> None:
    row_shape = (num_seqs, *key_cache.shape[1:])
    keys, values, slots = new_rows
    if keys.shape != row_shape or values.shape != row_shape or slots.shape != (num_seqs,):
        raise ValueError(
            f"new rows: keys {tuple(keys.shape)}, values {tuple(values.shape)} and slots "
            f"{tuple(slots.shape)} for {num_seqs} sequences of {tuple(row_shape[1:])} rows"
        )
    if keys.dtype != key_cache.dtype or values.dtype != value_cache.dtype:
        raise ValueError(
            f"new rows of {keys.dtype} and {values.dtype} for caches of {key_cache.dtype} "
            f"and {value_cache.dtype}: the dtypes must be the same"
        )
    if keys.stride(2) != 1 or values.stride(2) != 1:
        raise ValueError("the new rows' head_dim must be contiguous")
    if any(t.device != key_cache.device for t in new_rows) or slots.is_floating_point():
        raise ValueError("new rows: tensors on the caches' device, integer slots")


def paged_decode_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    block_table_width: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ground truth for ``paged_decode_attention``: a plain loop, float32 math.

    Reads device values on the host, so it syncs and cannot be captured. Returns float32.
    """
    num_seqs, num_heads, head_dim = query.shape
    group = num_heads // key_cache.shape[1]
    width = int(block_table_width.reshape(-1)[0])
    tables = block_tables.long()
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float32, device=query.device)
    for s in range(num_seqs):
        n = int(context_lens[s])
        if n == 0:
            continue
        pos = torch.arange(n, device=query.device)
        slots = tables[s * width + pos // block_size] * block_size + pos % block_size
        k = key_cache[slots].float().repeat_interleave(group, dim=1)  # [n, heads, head_dim]
        v = value_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[s].float(), k) * scale  # [heads, n]
        visible = torch.ones(1, n, dtype=torch.bool, device=query.device)
        if sliding_window is not None:
            visible = pos[None, :] >= n - sliding_window
        weights = reference_scores(scores, visible, softcap, sinks)
        out[s] = torch.einsum("hn,nhd->hd", weights, v)
    return out
