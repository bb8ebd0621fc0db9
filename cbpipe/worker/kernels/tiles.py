"""The online-softmax step both paged attention kernels share: a range of key tiles.

A tile is ``BLOCK_N`` consecutive key positions of one sequence, each looked up in its block
table, so any block size works with the same tile. ``(m_i, l_i, acc)`` is the running state
of a program's query rows: max score, sum of weights and unnormalised output, float32, in the
base-2 domain (``qk_scale`` already holds log2(e)).

Attention variants of a layer are compile-time switches (``tl.constexpr``), so a layer without
them runs exactly the code it ran before they existed:

- ``WINDOW`` > 0: a sliding window; row r sees only keys ``row_pos[r] - WINDOW < k``. A tile may
  then hold no key a row can see, even its first, so the update guards the running max.
- ``SOFTCAP``: scores become ``softcap * tanh(scores / softcap)`` before the mask, with
  ``softcap`` in the base-2 domain too (the layer's cap times log2(e)).
- Sinks (one logit per head that joins the softmax with no value) need no tile work: the
  kernels start the state at ``(m, l) = (sink, 1)``, as if one more key had been seen.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    """tanh from exp2, which every Triton version has: 1 - 2 / (e^2x + 1)."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    tile,
    end,
    row_pos,
    table,
    k_head,
    v_head,
    stride_k_slot,
    stride_v_slot,
    qk_scale,
    softcap,
    dims,
    dim_ok,
    io_dtype: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_END: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Update the state with the keys at positions tile .. tile+BLOCK_N.

    MASK_END: keys at or past ``end`` are masked and never read (the table row may end
    there); without it every key of the tile is below ``end``. CAUSAL: row r sees only keys
    at or before ``row_pos[r]``. WINDOW > 0: nor any at or before ``row_pos[r] - WINDOW``.
    """
    pos = tile + tl.arange(0, BLOCK_N)
    if MASK_END:
        pos_ok = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        k_mask = pos_ok[None, :] & dim_ok[:, None]
        v_mask = pos_ok[:, None] & dim_ok[None, :]
    else:
        block = tl.load(table + pos // BLOCK_SIZE)
        k_mask = dim_ok[:, None]  # broadcast by tl.load
        v_mask = dim_ok[None, :]
    # int64: slot * stride overflows int32 on caches of a few GB.
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE

    # Loaded transposed, [BLOCK_D, BLOCK_N], so the product needs no tl.trans.
    k = tl.load(k_head + slot[None, :] * stride_k_slot + dims[:, None], mask=k_mask, other=0.0)
    # "ieee": float32 inputs would otherwise be rounded to tf32; 16-bit ones ignore it.
    scores = tl.dot(q, k.to(q.dtype), input_precision="ieee") * qk_scale
    if SOFTCAP:
        scores = softcap * _tanh(scores / softcap)
    if CAUSAL:
        scores = tl.where(pos[None, :] <= row_pos[:, None], scores, float("-inf"))
    elif MASK_END:
        scores = tl.where(pos_ok[None, :], scores, float("-inf"))
    if WINDOW > 0:
        scores = tl.where(pos[None, :] > row_pos[:, None] - WINDOW, scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, 1))
    if WINDOW > 0:  # noqa: SIM108 (a constexpr branch: the variant without it is unchanged)
        # A row may have seen no key yet, here included: subtract 0 rather than -inf, so its
        # weights are exp2(-inf) = 0 and the old state's factor 0, not NaN.
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    else:
        # The callers make every row see a key in its first tile, so each row's running max
        # is finite from then on, and fully masked rows of later tiles add exp2(-inf) = 0.
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(scores - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    v = tl.load(v_head + slot[:, None] * stride_v_slot + dims[None, :], mask=v_mask, other=0.0)
    # p is rounded to the input dtype as on the GPU, whether or not the dot is upcast.
    p = p.to(io_dtype).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p, v.to(q.dtype), input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def attend_key(
    q,
    m_i,
    l_i,
    acc,
    key,
    value,
    seen,
    qk_scale,
    softcap,
    io_dtype: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Update the state with one key and value held in registers (``[dims]`` each), which
    every row sees if ``seen`` and none otherwise; each row's query is zero outside its own
    head's dims, so a row's product with packed keys is its own head's score."""
    scores = tl.sum(q.to(tl.float32) * key.to(tl.float32)[None, :], 1) * qk_scale
    if SOFTCAP:
        scores = softcap * _tanh(scores / softcap)
    scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m_i, scores)
    # A row that has seen no key (an empty split) keeps m = -inf: subtract 0, not -inf.
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(scores - m_use)
    l_i = l_i * alpha + p
    # p is rounded to the input dtype, as the tiles round it before their product with v.
    p = p.to(io_dtype).to(tl.float32)
    acc = acc * alpha[:, None] + p[:, None] * value.to(tl.float32)[None, :]
    return m_new, l_i, acc


@triton.jit
def attend_tiles(
    q,
    m_i,
    l_i,
    acc,
    start,
    stop,
    end,
    row_pos,
    table,
    k_head,
    v_head,
    stride_k_slot,
    stride_v_slot,
    qk_scale,
    softcap,
    dims,
    dim_ok,
    io_dtype: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_END: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """``_attend_tile`` for the tiles starting at start, start+BLOCK_N, ... below ``stop``."""
    if INTERPRETED:
        # Triton 3.6's interpreter turns range() bounds into ints with int() of a 1-element
        # array, which numpy >= 2.5 refuses; a while loop only needs bool().
        tile = start
        while tile < stop:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile, end, row_pos, table, k_head, v_head, stride_k_slot,
                stride_v_slot, qk_scale, softcap, dims, dim_ok, io_dtype, BLOCK_SIZE, BLOCK_N,
                MASK_END, CAUSAL, WINDOW, SOFTCAP,
            )  # fmt: skip
            tile += BLOCK_N
    else:
        # A for loop, which Triton software-pipelines (num_stages); a while loop it does not.
        for tile in range(start, stop, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile, end, row_pos, table, k_head, v_head, stride_k_slot,
                stride_v_slot, qk_scale, softcap, dims, dim_ok, io_dtype, BLOCK_SIZE, BLOCK_N,
                MASK_END, CAUSAL, WINDOW, SOFTCAP,
            )  # fmt: skip
    return m_i, l_i, acc
