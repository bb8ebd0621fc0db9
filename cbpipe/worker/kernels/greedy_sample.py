"""Greedy sampling over the vocabulary in Triton: each row's first argmax and its log-probability.

``greedy_sample(logits)`` gives, per row of ``[rows, vocab]`` logits, ``ids`` (int64) equal to
``torch.argmax(logits.float(), -1)``, ties to the first index, and ``logprobs`` (float32) equal
to ``log_softmax(logits.float())`` at that index, ``row_max - logsumexp(row)``, which is
``-log(sum(exp(x - row_max)))``.

Why a kernel of our own: the sampler's plain-torch version (``cbpipe.worker.sampler``) cuts
each row into pieces so inductor spreads a row over several programs, but inductor still
walks every piece twice, once for the maximum and its index and once for the sum of
exponentials shifted by it: on an H200, at batch 32 of Llama 3's 128256 logits, 23 us plus
2.4 us for the pass over the pieces, where one read of the 8 MB of bf16 logits at about
4 TB/s takes 2 to 3 us. One read is the floor, and the online softmax reaches it: the
running sum is rescaled whenever the running maximum grows, so the maximum, its first index
and the sum of exponentials all come out of the same pass.

Design:

* Each row is cut into ``num_pieces`` contiguous pieces of whole ``tile``-sized tiles (only
  the row's last tile is ragged), one program per (row, piece), so a batch of 32 still
  covers the 132 SMs several times over. ``num_pieces`` is a host integer chosen from the
  batch size, the vocabulary and the SM count (``num_pieces_for``).
* A program keeps its state per lane of the tile, not per tile: running maximum, the first
  index where that lane reached it, and the lane's sum of ``exp(x - max)``, all float32
  (int32 for the index). The loop body is element-wise, with one exponential per element
  and no reduction across the tile; the lanes are combined once, after the last tile. Each
  lane visits its indices in increasing order and moves its index only on a strictly larger
  value, so the lowest index among lanes holding the piece's maximum is the first one.
* Partials ``[rows, num_pieces]`` (maximum, first index, shifted sum) go to scratch, and a
  second kernel, one program per row, merges them: the lowest index among pieces holding
  the row's maximum (pieces are increasing ranges, so that is the first piece's), and the
  sum of each piece's sum rescaled to the row's maximum.
* ``-inf`` logits (masked tokens) are handled without NaNs: exponentials are taken against
  the running maximum clamped to the lowest finite float, so a lane or a piece that has
  seen only ``-inf`` keeps a sum of 0 and adds nothing; a row entirely ``-inf`` gives index
  0 and a NaN log-probability, as ``torch.argmax`` and ``log_softmax`` do. NaN logits give
  unspecified results.
* Two kernels rather than one: merging in the last program to finish a row would need an
  atomic counter reset for every replay of a CUDA graph and memory fences between programs,
  for a merge that is one small launch (not yet timed on its own).

Nothing about a launch depends on device values: the grids and the scratch come from host
integers, so a call never synchronises and can be captured in a CUDA graph. Only long-stable
``tl`` operations are used (masked loads and stores, ``tl.max``, ``tl.min``, ``tl.sum``,
``tl.where``, ``tl.exp2``, ``tl.log``), so the kernels compile with the Triton of torch 2.11
(3.6) through current, and run under Triton's CPU interpreter (``TRITON_INTERPRET=1`` before
this module is imported). ``tl.argmax`` is not used: its tie-breaking is not documented.

``cbpipe::greedy_sample`` (in ``cbpipe.worker.sampler``) wraps the launch as a custom op, so
``torch.compile`` leaves it opaque; off CUDA the op computes the same in plain torch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cbpipe.worker.kernels.jit import jit_varying

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Launch settings, not yet timed on a GPU (module attributes, for a benchmark to override).
# 8 elements a thread, one 16-byte load of bf16, in programs of 128 threads; ptxas gives the
# piece kernel 48 registers (Triton 3.9, sm_90a), so 10 programs fit an SM and 8 an SM run
# as one wave: batch 32 of 128256 logits is 32 x 32 programs of 4 tiles each.
_TILE = 1024
_NUM_WARPS = 4
_PROGRAMS_PER_SM = 8
# A power of two: the merge kernel's one padded width, so no batch size compiles a new one.
_MAX_PIECES = 256


@triton.jit
def _fold_tile(m, s, arg, x, idx):
    """Fold one tile ``x`` (float32, at indices ``idx``) into the per-lane state.

    ``m``: running maximum; ``arg``: first index where it was reached; ``s``: sum of
    ``exp(x - m)``. One exponential per element: with ``d = x - m``, a smaller ``x`` adds
    ``exp(d)`` and a larger one rescales the sum by ``exp(-d)`` and adds ``exp(0) = 1``.
    """
    lowest = -3.4028234663852886e38  # float32's lowest finite value
    log2e = 1.4426950408889634
    # Against the clamped maximum, an -inf x gives exp(-inf) = 0 rather than -inf - -inf.
    d = x - tl.maximum(m, lowest)
    e = tl.exp2(-tl.abs(d) * log2e)
    larger = x > m  # strict, so a lane keeps the first index of a repeated maximum
    s = tl.where(larger, s * e + 1.0, s + e)
    arg = tl.where(larger, idx, arg)
    m = tl.maximum(m, x)
    return m, s, arg


# The tiles per piece follow the batch size; specialising on them would compile variants
# mid-run. The vocabulary and the row stride are the model's and stay fixed.
@jit_varying("tiles_per_piece")
def _piece_kernel(
    logits_ptr,
    part_max_ptr,
    part_arg_ptr,
    part_sum_ptr,
    stride_row,
    vocab,
    tiles_per_piece,
    TILE: tl.constexpr,
):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    part = row * tl.num_programs(1) + piece
    lanes = tl.arange(0, TILE)
    # A whole number of tiles per piece: the compiler sees every full tile start aligned.
    start = piece * tiles_per_piece * TILE
    end = tl.minimum(start + tiles_per_piece * TILE, vocab)
    num_full = (end - start) // TILE
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row

    m = tl.full([TILE], float("-inf"), dtype=tl.float32)
    s = tl.zeros([TILE], dtype=tl.float32)
    # Starting at each lane's first index: a piece that is all -inf reports its first index.
    arg = start + lanes
    for t in range(num_full):
        idx = start + t * TILE + lanes
        x = tl.load(row_ptr + idx).to(tl.float32)
        m, s, arg = _fold_tile(m, s, arg, x, idx)
    # The ragged tail, if any; without one the whole tile is masked and reads nothing.
    idx = start + num_full * TILE + lanes
    x = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
    m, s, arg = _fold_tile(m, s, arg, x, idx)

    piece_max = tl.max(m, 0)
    piece_arg = tl.min(tl.where(m == piece_max, arg, vocab), 0)
    lowest = -3.4028234663852886e38
    log2e = 1.4426950408889634
    piece_sum = tl.sum(s * tl.exp2((m - tl.maximum(piece_max, lowest)) * log2e), 0)
    tl.store(part_max_ptr + part, piece_max)
    tl.store(part_arg_ptr + part, piece_arg)
    tl.store(part_sum_ptr + part, piece_sum)


@jit_varying("num_pieces")
def _merge_kernel(
    part_max_ptr,
    part_arg_ptr,
    part_sum_ptr,
    ids_ptr,
    logprobs_ptr,
    num_pieces,
    vocab,
    PIECES_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    pieces = tl.arange(0, PIECES_PAD)
    ok = pieces < num_pieces
    part = row * num_pieces + pieces
    m = tl.load(part_max_ptr + part, mask=ok, other=float("-inf"))
    arg = tl.load(part_arg_ptr + part, mask=ok, other=vocab)
    s = tl.load(part_sum_ptr + part, mask=ok, other=0.0)

    row_max = tl.max(m, 0)
    # The pieces are increasing ranges: the lowest index among those holding the maximum is
    # the first piece's first index, the row's first. Padding pieces hold the index vocab.
    ids = tl.min(tl.where(m == row_max, arg, vocab), 0)
    lowest = -3.4028234663852886e38
    log2e = 1.4426950408889634
    total = tl.sum(s * tl.exp2((m - tl.maximum(row_max, lowest)) * log2e), 0)
    # log p = x[id] - row_max - log(total) with x[id] = row_max: no large row_max to cancel.
    # An all -inf row has total 0; it gets NaN, as log_softmax gives it.
    logprob = tl.where(row_max > float("-inf"), -tl.log(total), float("nan"))
    tl.store(ids_ptr + row, ids.to(tl.int64))
    tl.store(logprobs_ptr + row, logprob)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_pieces_for(rows: int, vocab: int, num_sms: int, tile: int = _TILE) -> int:
    """Pieces per row for ``rows`` rows of ``vocab`` logits on ``num_sms`` SMs.

    Enough pieces for ``_PROGRAMS_PER_SM`` programs an SM, at most ``_MAX_PIECES`` and at
    most one per tile of the row; then as many as whole tiles per piece leave non-empty (the
    count that the launch uses, ``piece_layout``).
    """
    wanted = triton.cdiv(_PROGRAMS_PER_SM * num_sms, max(1, rows))
    wanted = max(1, min(wanted, _MAX_PIECES, triton.cdiv(vocab, tile)))
    return piece_layout(vocab, wanted, tile)[0]


def piece_layout(vocab: int, num_pieces: int, tile: int) -> tuple[int, int]:
    """``(pieces, tiles_per_piece)``: at most ``num_pieces`` pieces of whole tiles covering
    ``vocab``, none empty (fewer than asked when whole tiles cover the row sooner)."""
    tiles_per_piece = triton.cdiv(triton.cdiv(vocab, num_pieces), tile)
    return triton.cdiv(vocab, tiles_per_piece * tile), tiles_per_piece


def default_num_pieces(rows: int, vocab: int, device: torch.device) -> int:
    """Pieces per row from host-known sizes only; off CUDA (the interpreter) one SM."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return num_pieces_for(rows, vocab, _sm_count(index))
    return num_pieces_for(rows, vocab, 1)


def greedy_sample_triton(
    logits: torch.Tensor,
    *,
    num_pieces: int | None = None,
    tile: int = _TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the two kernels: each row's first argmax and its log-probability.

    Args:
        logits: ``[rows, vocab]`` float32, bfloat16 or float16; the rows may be strided, the
            vocabulary is made contiguous if it is not.
        num_pieces: pieces per row asked for (fewer are used when whole tiles cover the row
            sooner); None picks ``default_num_pieces``.
        tile: elements a program reads per step, a power of two (tests use small ones).

    Returns:
        ``ids`` int64 ``[rows]`` and ``logprobs`` float32 ``[rows]``.
    """
    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        raise ValueError(
            f"logits must be [rows, vocab] float32, bfloat16 or float16, got "
            f"{tuple(logits.shape)} {logits.dtype}"
        )
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits have an empty vocabulary")
    if num_pieces is None:
        num_pieces = default_num_pieces(rows, vocab, logits.device)
    if num_pieces < 1 or num_pieces > _MAX_PIECES:
        raise ValueError(f"num_pieces must be in 1..{_MAX_PIECES}, got {num_pieces}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return ids, logprobs

    num_pieces, tiles_per_piece = piece_layout(vocab, num_pieces, tile)
    part_max = torch.empty((rows, num_pieces), dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    part_arg = torch.empty((rows, num_pieces), dtype=torch.int32, device=logits.device)
    _piece_kernel[(rows, num_pieces)](
        logits,
        part_max,
        part_arg,
        part_sum,
        logits.stride(0),
        vocab,
        tiles_per_piece,
        TILE=tile,
        num_warps=_NUM_WARPS,
    )
    _merge_kernel[(rows,)](
        part_max, part_arg, part_sum, ids, logprobs, num_pieces, vocab, PIECES_PAD=_MAX_PIECES
    )
    return ids, logprobs
