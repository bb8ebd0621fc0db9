"""Sampled rows on the GPU in two passes over the vocabulary: the processing, then the draw.

``cbpipe.worker.sampler`` defines what a sampled row gets (``sample_full_reference``, plain
torch): logit bias, the penalties, temperature, min-p, top-k/top-p, the seeded Gumbel-max draw,
the raw logits' logsumexp for the log-probabilities. Compiled by inductor that chain ran as
ten kernels, each a one-dimensional walk over ``rows x vocab`` that reloads its row's
parameters per element and checks every gathered index; at 64 rows of Llama 3's 128,256
logits its kernels besides top-k/top-p took 0.27 ms, where their bytes take under 0.05
(docs/PERFORMANCE.md). Here:

* ``prepare``, one program per (row, piece) of whole tiles, as ``greedy_sample.py`` cuts rows:
  reads the logits once (and the request's state row, with the penalties' tables only when
  the row has a penalty), writes the processed row divided by the temperature (``scaled``,
  float32: what top-k/top-p, min-p and the draw read), and per piece: the raw logits' maximum
  and sum of ``exp(x - max)`` (the logsumexp), the processed logits' maximum and its first
  index (a greedy row's token), and the scaled row's maximum (min-p's reference).
* ``apply_min_p_``: in place on ``scaled``, only where top-k/top-p follow (they must see the
  min-p cut), one program a row; a row with ``min_p`` 0 returns at once. Then the truncation
  kernel (``truncation.py``) finds each row's cut.
* ``draw``: one program per (row, piece) again, the seeded noise added to ``scaled`` (min-p
  applied on the way when no truncation ran; else top-k/top-p's cut, which the truncation
  kernel hands over instead of writing the masked row), each piece's maximum and first
  index; then one program per row merges every piece's figures into the token (greedy rows
  the processed argmax), its raw log-probability and the logsumexp.

The noise is ``sampler._uniform``'s, bit for bit: the row's key (from its seed and output
index) and each token's hash run in uint32 (wrapping products, logical shifts). Each lane of
a tile keeps its own running figures and moves its index only on a strictly larger value, so
ties go to the first index, as ``argmax`` has them. Grids and scratch follow from host
integers: a call never synchronises, and a CUDA graph captures it. The ops around these
launches are in ``cbpipe.worker.sampler``; this module imports ``triton`` and is loaded only
for CUDA tensors (or under Triton's interpreter, which the CPU tests use).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbpipe.worker.kernels.jit import jit_varying
from cbpipe.worker.kernels.truncation import float_key, kept

# Elements a program reads per step, and whole tiles a piece: 63 pieces of Llama 3's row, so
# one row alone still spreads over half the SMs of an H100.
TILE = 1024
TILES_PER_PIECE = 2
_NUM_WARPS = 4
# The merge's padded width over a row's pieces (a power of two); vocabularies past
# MAX_PIECES * TILE * TILES_PER_PIECE take longer pieces.
MAX_PIECES = 256

# stats rows of ``prepare``'s ``[5, rows, pieces]`` float32 output
RAW_MAX, RAW_SUM, PROCESSED_MAX, SCALED_MAX, PROCESSED_ARG = range(5)

# Every kernel takes the batch's row count, which an eager step (a prefill's, a mixed step's
# hand-off) gives as whatever number of sequences samples: specialised, a row count of 1 or
# a multiple of 16 that no graph bucket had compiled a variant for while a server ran (1.7 s
# of an 8B run's first request, docs/PERFORMANCE.md). The vocabulary and strides are the
# model's and stay fixed.
_jit = jit_varying("rows")


def num_pieces(vocab: int, tile: int = TILE, tiles_per_piece: int = TILES_PER_PIECE) -> int:
    """Pieces of a row of ``vocab``: a function of the vocabulary alone (no batch size), so
    the ops' output shapes follow from their inputs' (``vocab`` may be a symbolic size)."""
    tiles = (vocab + tile - 1) // tile
    per_piece = max(tiles_per_piece, (tiles + MAX_PIECES - 1) // MAX_PIECES)
    return (tiles + per_piece - 1) // per_piece


def _tiles_per_piece(vocab: int, pieces: int, tile: int) -> int:
    """Whole tiles a piece when ``pieces`` cover the row: the same for every kernel."""
    return triton.cdiv(triton.cdiv(vocab, tile), pieces)


@triton.jit
def _fold_sum(m, s, x):
    """Fold ``x`` into each lane's running maximum ``m`` and sum ``s`` of ``exp(x - m)``;
    against the maximum clamped to the lowest float, so -inf adds 0 and makes no NaN."""
    d = x - tl.maximum(m, -3.4028234663852886e38)
    e = tl.exp2(-tl.abs(d) * 1.4426950408889634)
    s = tl.where(x > m, s * e + 1.0, s + e)
    return tl.maximum(m, x), s


@triton.jit
def _fold_arg(m, arg, x, idx):
    """Each lane's running maximum and the first index it was reached at (strictly larger
    values only move it)."""
    larger = x > m
    return tl.maximum(m, x), tl.where(larger, idx, arg)


@_jit
def _prepare_kernel(
    logits_ptr,
    bias_ptr,
    counts_ptr,
    seen_ptr,
    state_rows_ptr,
    temperature_ptr,
    presence_ptr,
    frequency_ptr,
    repetition_ptr,
    scaled_ptr,
    stats_ptr,
    stride_row,
    rows,
    vocab,
    tiles_per_piece,
    HAS_STATE: tl.constexpr,
    TILE: tl.constexpr,
):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    lanes = tl.arange(0, TILE)
    start = piece * tiles_per_piece * TILE
    end = tl.minimum(start + tiles_per_piece * TILE, vocab)
    x_row = logits_ptr + row.to(tl.int64) * stride_row
    out_row = scaled_ptr + row.to(tl.int64) * vocab
    temperature = tl.maximum(tl.load(temperature_ptr + row), 1e-6)
    if HAS_STATE:
        state_row = tl.load(state_rows_ptr + row).to(tl.int64) * vocab
        presence = tl.load(presence_ptr + row)
        frequency = tl.load(frequency_ptr + row)
        repetition = tl.load(repetition_ptr + row)
        # Neutral penalties leave every logit exactly as it was: skip their tables' bytes.
        penalised = (presence != 0.0) | (frequency != 0.0) | (repetition != 1.0)

    raw_max = tl.full([TILE], float("-inf"), dtype=tl.float32)
    raw_sum = tl.zeros([TILE], dtype=tl.float32)
    best = tl.full([TILE], float("-inf"), dtype=tl.float32)
    best_arg = start + lanes
    scaled_max = tl.full([TILE], float("-inf"), dtype=tl.float32)
    for t in range(tiles_per_piece):
        idx = start + t * TILE + lanes
        inside = idx < end
        x = tl.load(x_row + idx, mask=inside, other=float("-inf")).to(tl.float32)
        raw_max, raw_sum = _fold_sum(raw_max, raw_sum, x)
        logit = x
        if HAS_STATE:
            # sampler.apply_penalties, operation for operation.
            logit = logit + tl.load(bias_ptr + state_row + idx, mask=inside, other=0.0)
            if penalised:
                seen = tl.load(seen_ptr + state_row + idx, mask=inside, other=0) != 0
                count = tl.load(counts_ptr + state_row + idx, mask=inside, other=0)
                repeated = tl.where(logit > 0.0, logit / repetition, logit * repetition)
                logit = tl.where(seen, repeated, logit)
                logit = logit - frequency * count.to(tl.float32)
                logit = logit - presence * (count > 0).to(tl.float32)
            logit = tl.where(inside, logit, float("-inf"))
        best, best_arg = _fold_arg(best, best_arg, logit, idx)
        scaled = logit / temperature
        scaled_max = tl.maximum(scaled_max, scaled)
        tl.store(out_row + idx, scaled, mask=inside)

    part = row * tl.num_programs(1) + piece
    plane = rows * tl.num_programs(1)
    piece_max = tl.max(raw_max, 0)
    shift = tl.maximum(piece_max, -3.4028234663852886e38)
    tl.store(stats_ptr + part, piece_max)
    piece_sum = tl.sum(raw_sum * tl.exp2((raw_max - shift) * 1.4426950408889634), 0)
    tl.store(stats_ptr + plane + part, piece_sum)
    piece_best = tl.max(best, 0)
    tl.store(stats_ptr + 2 * plane + part, piece_best)
    tl.store(stats_ptr + 3 * plane + part, tl.max(scaled_max, 0))
    first = tl.min(tl.where(best == piece_best, best_arg, vocab), 0)
    tl.store(stats_ptr + 4 * plane + part, first.to(tl.float32))


@triton.jit
def _row_scaled_max(stats_ptr, row, rows, pieces, PIECES_PAD: tl.constexpr):
    at = tl.arange(0, PIECES_PAD)
    part = 3 * rows * pieces + row * pieces + at
    return tl.max(tl.load(stats_ptr + part, mask=at < pieces, other=float("-inf")), 0)


@_jit
def _min_p_kernel(
    scaled_ptr,
    stats_ptr,
    min_p_ptr,
    rows,
    pieces,
    vocab,
    TILE: tl.constexpr,
    PIECES_PAD: tl.constexpr,
):
    # One program a whole row: most rows have no min-p and return at once, where a program
    # per piece cost a launch of rows x pieces empty programs (10 us at 256 rows).
    row = tl.program_id(0)
    min_p = tl.load(min_p_ptr + row)
    if min_p > 0.0:
        row_max = _row_scaled_max(stats_ptr, row, rows, pieces, PIECES_PAD)
        out_row = scaled_ptr + row.to(tl.int64) * vocab
        for start in range(0, vocab, TILE):
            idx = start + tl.arange(0, TILE)
            inside = idx < vocab
            scaled = tl.load(out_row + idx, mask=inside, other=float("-inf"))
            drop = tl.exp(scaled - row_max) < min_p  # sampler.apply_min_p's test
            tl.store(out_row + idx, float("-inf"), mask=inside & drop)


@triton.jit
def _mix32(x):
    """``sampler._mix32`` on uint32: products wrap modulo 2**32, shifts are logical."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x5F356495
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed_ptr, output_index_ptr, row):
    """``sampler._row_keys`` for one row, in uint32: the int64 version's values never leave
    32 bits (each product is reduced modulo 2**32, each shift is of a non-negative value)."""
    seed = tl.load(seed_ptr + row).to(tl.int64)
    low = (seed & 0xFFFFFFFF).to(tl.uint32)
    high = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    index = (tl.load(output_index_ptr + row).to(tl.int64) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32(low ^ _mix32(high))
    return _mix32(key ^ _mix32(index))


@_jit
def _draw_kernel(
    scaled_ptr,
    stats_ptr,
    min_p_ptr,
    cut_ptr,
    seed_ptr,
    output_index_ptr,
    draws_ptr,
    rows,
    vocab,
    tiles_per_piece,
    APPLY_MIN_P: tl.constexpr,
    APPLY_CUT: tl.constexpr,
    TILE: tl.constexpr,
    PIECES_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    lanes = tl.arange(0, TILE)
    start = piece * tiles_per_piece * TILE
    end = tl.minimum(start + tiles_per_piece * TILE, vocab)
    in_row = scaled_ptr + row.to(tl.int64) * vocab
    key = _row_key(seed_ptr, output_index_ptr, row)
    if APPLY_MIN_P:
        min_p = tl.load(min_p_ptr + row)
        row_max = _row_scaled_max(stats_ptr, row, rows, tl.num_programs(1), PIECES_PAD)
    if APPLY_CUT:
        boundary = tl.load(cut_ptr + 2 * row)
        last = tl.load(cut_ptr + 2 * row + 1)
    best = tl.full([TILE], float("-inf"), dtype=tl.float32)
    best_arg = start + lanes
    for t in range(tiles_per_piece):
        idx = start + t * TILE + lanes
        inside = idx < end
        scaled = tl.load(in_row + idx, mask=inside, other=float("-inf"))
        if APPLY_MIN_P:
            scaled = tl.where(tl.exp(scaled - row_max) < min_p, float("-inf"), scaled)
        if APPLY_CUT:
            scaled = tl.where(kept(float_key(scaled), idx, boundary, last), scaled, float("-inf"))
        bits = _mix32(key ^ (idx.to(tl.uint32) * 0x2545F491))
        bits = _mix32(bits ^ key)
        uniform = ((bits >> 9).to(tl.float32) + 0.5) / 8388608.0  # 2**23
        noisy = scaled - tl.log(-tl.log(uniform))
        best, best_arg = _fold_arg(best, best_arg, tl.where(inside, noisy, float("-inf")), idx)
    part = row * tl.num_programs(1) + piece
    piece_best = tl.max(best, 0)
    tl.store(draws_ptr + part, piece_best)
    first = tl.min(tl.where(best == piece_best, best_arg, vocab), 0)
    tl.store(draws_ptr + rows * tl.num_programs(1) + part, first.to(tl.float32))


@triton.jit
def _first_best(values_ptr, args_ptr, at, ok, vocab):
    """The first index of a row's best value over its pieces (increasing ranges: the first
    piece holding the maximum holds its first index)."""
    values = tl.load(values_ptr + at, mask=ok, other=float("-inf"))
    args = tl.load(args_ptr + at, mask=ok, other=vocab)
    return tl.min(tl.where(values == tl.max(values, 0), args, vocab), 0).to(tl.int64)


@_jit
def _merge_kernel(
    logits_ptr,
    stats_ptr,
    draws_ptr,
    temperature_ptr,
    ids_ptr,
    logprobs_ptr,
    lse_ptr,
    stride_row,
    rows,
    pieces,
    vocab,
    PIECES_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    at = tl.arange(0, PIECES_PAD)
    ok = at < pieces
    plane = rows * pieces
    part = row * pieces + at
    raw_max = tl.load(stats_ptr + part, mask=ok, other=float("-inf"))
    raw_sum = tl.load(stats_ptr + plane + part, mask=ok, other=0.0)
    row_max = tl.max(raw_max, 0)
    shift = tl.maximum(row_max, -3.4028234663852886e38)
    total = tl.sum(raw_sum * tl.exp2((raw_max - shift) * 1.4426950408889634), 0)
    lse = row_max + tl.log(total)
    greedy = _first_best(stats_ptr + 2 * plane, stats_ptr + 4 * plane, part, ok, vocab)
    sampled = _first_best(draws_ptr, draws_ptr + plane, part, ok, vocab)
    token = tl.where(tl.load(temperature_ptr + row) == 0.0, greedy, sampled)
    # The pieces' maxima ignore NaN logits (a broken model's: tests/unit), so some piece
    # always holds the maximum; should none, the index would be its sentinel, the
    # vocabulary's size, and the load below would read one past the row: keep it a token.
    token = tl.minimum(token, vocab - 1)
    chosen = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32)
    tl.store(ids_ptr + row, token)
    tl.store(logprobs_ptr + row, chosen - lse)
    tl.store(lse_ptr + row, lse)


def prepare_triton(
    logits: torch.Tensor,  # [rows, vocab], unit stride along the vocabulary
    temperature: torch.Tensor,  # [rows] float32
    state: tuple[torch.Tensor, ...] | None = None,
    *,
    tile: int = TILE,
    tiles_per_piece: int = TILES_PER_PIECE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scaled, stats)``: the processed logits over the temperature, ``[rows, vocab]``
    float32, and each piece's figures, ``[5, rows, pieces]`` float32 (the ``RAW_MAX`` ...
    ``PROCESSED_ARG`` planes; indices are exact in float32 below 2**24).

    ``state``: ``(bias, output_counts, seen, state_rows, presence, frequency, repetition)``,
    the request state's tables and each row's index into them and penalties; None for rows
    with no processing (``sampler.sample``)."""
    rows, vocab = logits.shape
    if vocab >= 1 << 24:
        raise ValueError(f"a vocabulary of {vocab} tokens: indices past 2**24 are not exact")
    pieces = num_pieces(vocab, tile, tiles_per_piece)
    scaled = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    stats = torch.empty((5, rows, pieces), dtype=torch.float32, device=logits.device)
    if rows == 0:
        return scaled, stats
    bias, counts, seen, state_rows, presence, frequency, repetition = state or (temperature,) * 7
    _prepare_kernel[(rows, pieces)](
        logits, bias, counts, seen, state_rows, temperature, presence, frequency, repetition,
        scaled, stats, logits.stride(0), rows, vocab, _tiles_per_piece(vocab, pieces, tile),
        HAS_STATE=state is not None, TILE=tile, num_warps=_NUM_WARPS,
    )  # fmt: skip
    return scaled, stats


def apply_min_p_triton(
    scaled: torch.Tensor, stats: torch.Tensor, min_p: torch.Tensor, *, tile: int = TILE
) -> None:
    """Set to ``-inf``, in place, what min-p drops from each row of ``scaled``."""
    rows, vocab = scaled.shape
    pieces = stats.shape[2]
    if rows:
        _min_p_kernel[(rows,)](
            scaled, stats, min_p, rows, pieces, vocab, TILE=tile, PIECES_PAD=MAX_PIECES,
            num_warps=_NUM_WARPS,
        )  # fmt: skip


def draw_triton(
    logits: torch.Tensor,  # [rows, vocab]: the raw logits, for the chosen token's logit
    scaled: torch.Tensor,  # [rows, vocab] float32, from prepare (truncated or not)
    stats: torch.Tensor,  # [5, rows, pieces], from prepare
    temperature: torch.Tensor,  # [rows] float32; 0: the processed argmax
    seed: torch.Tensor,  # [rows] int64
    output_index: torch.Tensor,  # [rows] int32: which output each row draws
    min_p: torch.Tensor | None = None,  # [rows] float32, applied here when given
    cut: torch.Tensor | None = None,  # [rows, 2] int32: top-k/top-p's cut, applied when given
    *,
    tile: int = TILE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, logprobs, lse)``, ``[rows]`` each: the token (int64), its raw log-probability
    and the raw logits' logsumexp (float32)."""
    rows, vocab = scaled.shape
    pieces = stats.shape[2]
    device = scaled.device
    ids = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    if rows == 0:
        return ids, logprobs, lse
    draws = torch.empty((2, rows, pieces), dtype=torch.float32, device=device)
    _draw_kernel[(rows, pieces)](
        scaled, stats, temperature if min_p is None else min_p, seed if cut is None else cut,
        seed, output_index, draws, rows, vocab, _tiles_per_piece(vocab, pieces, tile),
        APPLY_MIN_P=min_p is not None, APPLY_CUT=cut is not None, TILE=tile,
        PIECES_PAD=MAX_PIECES, num_warps=_NUM_WARPS,
    )  # fmt: skip
    _merge_kernel[(rows,)](
        logits, stats, draws, temperature, ids, logprobs, lse, logits.stride(0), rows, pieces,
        vocab, PIECES_PAD=MAX_PIECES,
    )  # fmt: skip
    return ids, logprobs, lse
