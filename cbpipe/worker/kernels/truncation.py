"""Top-k and top-p in Triton without sorting the vocabulary: each row's cut by bisection.

``top_k_top_p_triton(logits, top_k, top_p)`` returns float32 ``[rows, vocab]`` logits with
every token that top-k and then top-p drop set to ``-inf``, as the sort in
``cbpipe.worker.sampler.top_k_top_p_reference`` does: the tokens in order of logit
descending, ties by index ascending (a stable sort); top-k keeps the first ``top_k`` of them
(0 keeps all), and top-p keeps, of those, each token whose probability mass before it
(softmax over the top-k set) is below ``top_p`` (1 keeps all). The first token always stays.

Why not sort: sorting each row of 128256 float32 logits with int64 indices, scattering it
back and a few passes over the sorted copy are most of a sampled decode step's cost at small
batches (docs/PERFORMANCE.md); the cut needs only one element of that order, its *boundary*.

Design, one program a row:

* Keys: each logit's float32 bits as an int32 that orders like the float (``_key``), so a
  boundary is a key ``T`` and ``ties``, how many tokens of key ``T`` stay (the first by
  index). Every token of a larger key stays, every token of a smaller one goes.
* A first pass takes the row's maximum, its smallest finite logit, how many are finite and
  ``Z``, the sum of ``exp(x - max)`` (online, as ``greedy_sample.py``'s kernel does).
* The search for a boundary keeps two keys: ``lo``, whose suffix (the tokens of key ``>= lo``)
  reaches the target count and mass, and ``hi``, whose suffix does not. Each step is a pass
  over the row that counts and sums the suffix of a pivot between them: the midpoint of their
  values while the values span at most ``_VALUE_SPAN`` (logits near each other converge in
  few steps) and for at most ``_VALUE_STEPS`` steps, otherwise of their keys (at most 32
  steps from any bounds).
* The search stops when at most ``CAP`` tokens lie between the bounds: one more pass gathers
  their keys into scratch (each token's slot from an atomic counter rather than a scan over
  each step's tokens, which a plain pass has none of), and the bisection goes on over those
  in registers, each step's pivot between the smallest and largest candidate left, until
  one key is left, the boundary's. Or it stops when the bounds are adjacent keys, so every
  token between them ties. Either way the boundary's ``ties`` follow by arithmetic, since
  tied tokens weigh the same (a row of bf16 logits has ties by the thousand). No sort:
  ``tl.sort`` of 2,048 candidates cost about as much as six passes over the row.
* Top-k searches by count (no exponentials), then one pass sums the top-k set's mass
  ``Z_k``; top-p searches the top-k set's tokens by mass for ``top_p * Z_k``.
* When the cut falls inside the boundary's ties, the index of the last tie kept comes from a
  bisection over the gathered indices (or, past ``CAP`` ties, over the row).
* A last pass writes each logit or ``-inf``; or, for a caller that reads the row anyway
  (the sampler's draw), the row's cut is stored instead: the boundary's key and the index
  of its last tie kept (``top_k_top_p_cut_triton``, ``kept``).

A row's passes: the first, the search's (one or two for a peaked distribution, more for a
flat one), one gather, one more with top-k, and the write.
Nothing about a launch depends on device values, so a call never synchronises and can be
captured in a CUDA graph. A pass's masses are float32 sums, a lane's then the lanes', in an
order fixed by the tokens' indices; the gathered candidates' masses are summed in fixed point,
since their order in scratch is the atomics'. So a row's cut is the same in every run (and on
every tensor-parallel rank, which must agree on the token). The tests hold the cut to within
1e-5 of probability mass of float64's; the sort's float32 running
sum over tens of thousands of tokens drifts further, so the two may cut a few tokens apart
on a flat row. ``-inf`` logits never stay past the cut and are never counted; NaN and
``+inf`` logits give unspecified results. A row whose ``top_p`` is not positive keeps every
token (the protocol refuses such a value; graph padding rows carry 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Launch settings (module attributes, for a benchmark to override). A pass over one row is
# a single program's loop, so its speed is the bytes each step has in flight: 32 KB a step
# (16 logits a thread at 16 warps, 128 registers) rather than 8 KB, whose passes ran at the
# latency of a load a step (docs/PERFORMANCE.md). A search goes on in registers once at
# most CAP tokens are left between its bounds.
_BLOCK = 8192
_CAP = 4096
_NUM_WARPS = 16


@triton.jit
def float_key(x):
    """float32 -> int32 of the same order (``-0.0`` just below ``0.0``)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def kept(key, idx, boundary, last):
    """Whether a token stays, from its key and index and the row's cut ``(boundary,
    last)``: every key above the boundary's, and the boundary's ties up to index ``last``."""
    return (key > boundary) | ((key == boundary) & (idx <= last))


@triton.jit
def _value(key):
    """The inverse of ``_key``."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _weight(x, row_max):
    """``exp(x - row_max)``: a token's probability times the row's ``Z``."""
    return tl.exp2((x - row_max) * 1.4426950408889634)


# A candidate's weight, in (0, 1], in units of 2**-48: exact for weights of at least 2**-24
# (float32's 24 bits then lie above the binary point), and CAP of them stay below 2**62.
_MAX_CAP = 1 << 14


@triton.jit
def _units(weight):
    """A weight in fixed point, int64: truncated below 2**-48, a mass error of at most
    ``CAP * 2**-48`` (about 1e-11) of the row's Z."""
    return (weight * 281474976710656.0).to(tl.int64)  # 2**48


@triton.jit
def _mass(units):
    """Fixed-point units back to a float32 mass: rounding a given integer is deterministic."""
    return units.to(tl.float32) * 3.552713678800501e-15  # 2**-48


@triton.jit
def _suffix(row_ptr, vocab, pivot, row_max, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """How many tokens have a key of at least ``pivot``, and (with ``MASS``) their mass."""
    lanes = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    mass = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        idx = start + lanes
        # Past the row: -inf, whose key is below any pivot (pivots lie above a finite logit).
        x = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf"))
        hit = float_key(x) >= pivot
        count += hit.to(tl.int32)
        if MASS:
            mass += tl.where(hit, _weight(x, row_max), 0.0)
    return tl.sum(count, 0), tl.sum(mass, 0)


@triton.jit
def _gather(
    row_ptr, keys_ptr, index_ptr, counter_ptr, vocab, lo, hi,
    BLOCK: tl.constexpr, CAP: tl.constexpr,
):  # fmt: skip
    """Store the key and index of every token whose key lies in ``[lo, hi)`` into scratch, in
    no particular order: each takes its slot from an atomic counter, so the pass has no scan.
    The caller's count says at most ``CAP`` tokens lie there; past ``CAP`` nothing is stored
    all the same, since NaN logits make the counts disagree with the keys."""
    tl.store(counter_ptr, 0)
    tl.debug_barrier()
    lanes = tl.arange(0, BLOCK)
    counter = counter_ptr + tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + lanes
        x = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf"))
        key = float_key(x)
        inside = (key >= lo) & (key < hi) & (idx < vocab)
        slot = tl.atomic_add(counter, 1, mask=inside, sem="relaxed", scope="cta")
        fits = inside & (slot < CAP)
        tl.store(keys_ptr + slot, key, mask=fits)
        tl.store(index_ptr + slot, idx, mask=fits)
    tl.debug_barrier()  # the scratch is read back by other threads


@triton.jit
def _last_tie(
    row_ptr, keys_ptr, index_ptr, vocab, boundary, ties, gathered,
    BLOCK: tl.constexpr, CAP: tl.constexpr,
):  # fmt: skip
    """The index of the ``ties``-th token, in index order, of those whose key is
    ``boundary``: by bisection over the indices in scratch, where the search that found the
    boundary left its ``gathered`` candidates, ties included; or, when it gathered none (more
    ties than scratch holds), over the row."""
    low = tl.zeros([], dtype=tl.int32)
    high = tl.zeros([], dtype=tl.int32) + vocab - 1
    if gathered > 0:
        pos = tl.arange(0, CAP)
        valid = pos < gathered
        keys = tl.load(keys_ptr + pos, mask=valid, other=0)
        index = tl.load(index_ptr + pos, mask=valid, other=0)
        index = tl.where(valid & (keys == boundary), index, vocab)  # vocab: not a tie
        while low < high:
            middle = (low + high) >> 1
            # The answer is at most middle if enough ties lie at or below it.
            enough = tl.sum((index <= middle).to(tl.int32), 0) >= ties
            high = tl.where(enough, middle, high)
            low = tl.where(enough, low, middle + 1)
    else:
        lanes = tl.arange(0, BLOCK)
        while low < high:
            middle = (low + high) >> 1
            count = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(0, vocab, BLOCK):
                idx = start + lanes
                x = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf"))
                count += ((float_key(x) == boundary) & (idx <= middle)).to(tl.int32)
            enough = tl.sum(count, 0) >= ties
            high = tl.where(enough, middle, high)
            low = tl.where(enough, low, middle + 1)
    return low


@triton.jit
def _step_sums(c1, m1, a1, b1, d1, e1, c2, m2, a2, b2, d2, e2):
    """One register step's reduction in one tree: a count and a mass summed, the lowest and
    highest key of the candidates on each side of the pivot."""
    return (
        c1 + c2, m1 + m2,
        tl.minimum(a1, a2), tl.maximum(b1, b2), tl.minimum(d1, d2), tl.maximum(e1, e2),
    )  # fmt: skip


@triton.jit
def _search(
    row_ptr,
    keys_ptr,
    index_ptr,
    counter_ptr,
    vocab,
    row_max,
    lo,
    hi,
    count_lo,
    count_hi,
    mass_hi,
    want_count,
    want_mass,
    MASS: tl.constexpr,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    VALUE_SPAN: tl.constexpr,
    VALUE_STEPS: tl.constexpr,
):
    """The boundary ``(key, ties, tied, gathered)`` of the shortest prefix of the order whose
    count reaches ``want_count`` and whose mass reaches ``want_mass``: its key, how many tokens
    of that key the prefix holds, how many there are, and how many tokens (the boundary's
    ties among them) the search left in scratch, if it gathered.

    ``lo``'s suffix reaches both and ``hi``'s does not (``hi > lo``); ``count_lo``,
    ``count_hi`` and ``mass_hi`` are their suffixes' counts and ``hi``'s mass.
    """
    # Loop-carried values as tensors from the start (callers may pass Python constants).
    count_hi = count_hi + tl.zeros([], dtype=tl.int32)
    mass_hi = mass_hi + tl.zeros([], dtype=tl.float32)
    step = tl.zeros([], dtype=tl.int32)
    while (count_lo - count_hi > CAP) & (hi.to(tl.int64) - lo.to(tl.int64) > 1):
        lo_x = _value(lo)
        hi_x = _value(hi)
        by_value = float_key(lo_x + (hi_x - lo_x) * 0.5)
        by_key = ((lo.to(tl.int64) + hi.to(tl.int64)) >> 1).to(tl.int32)
        use_value = (step < VALUE_STEPS) & (hi_x - lo_x <= VALUE_SPAN)
        use_value = use_value & (by_value > lo) & (by_value < hi)
        pivot = tl.where(use_value, by_value, by_key)
        count, mass = _suffix(row_ptr, vocab, pivot, row_max, MASS, BLOCK)
        reached = (count >= want_count) & (mass >= want_mass)
        lo = tl.where(reached, pivot, lo)
        count_lo = tl.where(reached, count, count_lo)
        hi = tl.where(reached, hi, pivot)
        count_hi = tl.where(reached, count_hi, count)
        mass_hi = tl.where(reached, mass_hi, mass)
        step += 1

    between = count_lo - count_hi
    if between <= CAP:
        # Gather the keys between the bounds into scratch, then bisect those in registers:
        # each step splits the candidates left between the bounds by a pivot among their own
        # keys, until one key is left, the boundary's.
        _gather(row_ptr, keys_ptr, index_ptr, counter_ptr, vocab, lo, hi, BLOCK, CAP)
        valid = tl.arange(0, CAP) < between
        keys = tl.load(keys_ptr + tl.arange(0, CAP), mask=valid, other=0)
        # The candidates' masses in fixed point: the gather leaves them in scratch in an
        # order of the atomics' making, and integer sums, unlike float ones, do not depend on
        # it, so a row's cut is the same in every run and on every tensor-parallel rank.
        units = tl.where(valid, _units(_weight(_value(keys), row_max)), 0)
        low = tl.min(tl.where(valid, keys, 2147483647), 0)
        high = tl.max(tl.where(valid, keys, -2147483647 - 1), 0)
        step = tl.zeros([], dtype=tl.int32)
        while low < high:
            # A pivot in (low, high], so that candidates lie on both sides of it.
            low_x = _value(low)
            by_value = float_key(low_x + (_value(high) - low_x) * 0.5)
            by_key = ((low.to(tl.int64) + high.to(tl.int64) + 1) >> 1).to(tl.int32)
            use_value = (step < VALUE_STEPS) & (by_value > low) & (by_value <= high)
            pivot = tl.where(use_value, by_value, by_key)
            hit = valid & (keys >= pivot)
            left = valid & (keys >= low) & (keys <= high)
            upper = left & hit
            lower = left & ~hit
            count, mass, upper_low, upper_high, lower_low, lower_high = tl.reduce(
                (
                    hit.to(tl.int32), tl.where(hit, units, 0),
                    tl.where(upper, keys, 2147483647), tl.where(upper, keys, -2147483647 - 1),
                    tl.where(lower, keys, 2147483647), tl.where(lower, keys, -2147483647 - 1),
                ),
                0,
                _step_sums,
            )  # fmt: skip
            reached = (count_hi + count >= want_count) & (mass_hi + _mass(mass) >= want_mass)
            # The candidates at or above the pivot if it is reached, below it if not.
            low = tl.where(reached, upper_low, lower_low)
            high = tl.where(reached, upper_high, lower_high)
            step += 1
        boundary = low
        above = valid & (keys > boundary)
        above_count = count_hi + tl.sum(above.to(tl.int32), 0)
        above_mass = mass_hi + _mass(tl.sum(tl.where(above, units, 0), 0))
        tied = tl.sum((valid & (keys == boundary)).to(tl.int32), 0)
        gathered = between
    else:
        # Adjacent bounds: every token between them has key lo.
        boundary = lo
        above_count = count_hi
        above_mass = mass_hi
        tied = between
        gathered = tl.zeros([], dtype=tl.int32)
    # How many of the boundary's ties (each of the same mass) the targets need.
    tie_mass = _weight(_value(boundary), row_max)
    need = tl.ceil((want_mass - above_mass) / tie_mass)  # +inf if the ties weigh nothing
    need = tl.minimum(need, tied.to(tl.float32)).to(tl.int32)
    ties = tl.maximum(tl.maximum(want_count - above_count, need), 1)
    ties = tl.minimum(ties, tied)
    return boundary, ties, tied, gathered


@triton.jit
def _top_k_top_p_kernel(
    logits_ptr,
    out_ptr,
    top_k_ptr,
    top_p_ptr,
    scratch_ptr,
    stride_in,
    stride_out,
    vocab,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    VALUE_SPAN: tl.constexpr,
    VALUE_STEPS: tl.constexpr,
    WRITE: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_in
    out_row = out_ptr + row.to(tl.int64) * stride_out
    # A row's scratch: CAP keys, CAP indices, a counter.
    keys_ptr = scratch_ptr + row.to(tl.int64) * (2 * CAP + 1)
    index_ptr = keys_ptr + CAP
    counter_ptr = index_ptr + CAP
    top_k = tl.load(top_k_ptr + row).to(tl.int32)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    lanes = tl.arange(0, BLOCK)
    lowest = -3.4028234663852886e38  # float32's lowest finite value

    # The row's maximum and Z (per lane, the running sum rescaled as the maximum grows), its
    # smallest finite logit and how many are finite.
    lane_max = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    lane_sum = tl.zeros([BLOCK], dtype=tl.float32)
    lane_min = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    lane_finite = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + lanes
        x = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf"))
        d = x - tl.maximum(lane_max, lowest)
        e = tl.exp2(-tl.abs(d) * 1.4426950408889634)
        lane_sum = tl.where(x > lane_max, lane_sum * e + 1.0, lane_sum + e)
        lane_max = tl.maximum(lane_max, x)
        finite = x > float("-inf")
        lane_min = tl.where(finite, tl.minimum(lane_min, x), lane_min)
        lane_finite += finite.to(tl.int32)
    row_max = tl.max(lane_max, 0)
    shift = tl.maximum(row_max, lowest)
    total = tl.sum(lane_sum * tl.exp2((lane_max - shift) * 1.4426950408889634), 0)
    row_min = tl.min(lane_min, 0)
    finite = tl.sum(lane_finite, 0)
    top = float_key(row_max) + 1  # no token's key reaches it

    # Keep everything unless a search finds a boundary (the lowest key is a NaN's).
    boundary = tl.zeros([], dtype=tl.int32) - 2147483647 - 1
    ties = tl.zeros([], dtype=tl.int32) + vocab
    tied = tl.zeros([], dtype=tl.int32)
    gathered = tl.zeros([], dtype=tl.int32)
    cuts_k = (top_k > 0) & (top_k < finite)
    kept_count = finite
    kept_mass = total
    if cuts_k:
        boundary, ties, tied, gathered = _search(
            row_ptr, keys_ptr, index_ptr, counter_ptr, vocab, row_max, float_key(row_min), top,
            finite, 0, 0.0, top_k, 0.0, False, BLOCK, CAP, VALUE_SPAN, VALUE_STEPS,
        )  # fmt: skip
        kept_count, kept_mass = _suffix(row_ptr, vocab, boundary + 1, row_max, True, BLOCK)
        # kept_* are now the part of the top-k set above the boundary's key.
    if (top_p < 1.0) & (top_p > 0.0) & (finite > 0):
        tie_mass = _weight(_value(boundary), row_max)
        want = top_p * tl.where(cuts_k, kept_mass + ties * tie_mass, total)
        if cuts_k & (kept_mass < want):
            # The top-p boundary is among the top-k boundary's ties.
            need = tl.ceil((want - kept_mass) / tie_mass)
            ties = tl.maximum(tl.minimum(need, ties.to(tl.float32)).to(tl.int32), 1)
        else:
            lo = tl.where(cuts_k, boundary + 1, float_key(row_min))
            boundary, ties, tied, gathered = _search(
                row_ptr, keys_ptr, index_ptr, counter_ptr, vocab, row_max, lo, top,
                kept_count, 0, 0.0, 0, want, True, BLOCK, CAP, VALUE_SPAN, VALUE_STEPS,
            )  # fmt: skip

    # The boundary's ties stay up to the index of the last one kept.
    last = tl.zeros([], dtype=tl.int32) + vocab
    if ties < tied:
        last = _last_tie(row_ptr, keys_ptr, index_ptr, vocab, boundary, ties, gathered,
                         BLOCK, CAP)  # fmt: skip
    if WRITE:
        for start in range(0, vocab, BLOCK):
            idx = start + lanes
            inside = idx < vocab
            x = tl.load(row_ptr + idx, mask=inside, other=float("-inf"))
            keep = kept(float_key(x), idx, boundary, last)
            tl.store(out_row + idx, tl.where(keep, x, float("-inf")), mask=inside)
    else:
        tl.store(out_ptr + row * 2, boundary)
        tl.store(out_ptr + row * 2 + 1, last)


# Value pivots while the bounds' logits are this close, for this many steps: beyond them
# (a logit bias of -1e30, or values crowding near zero) key pivots bound the search.
_VALUE_SPAN = 1024.0
_VALUE_STEPS = 16


def top_k_top_p_triton(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    block: int | None = None,
    cap: int | None = None,
) -> torch.Tensor:
    """Mask what top-k and then top-p drop, one program a row.

    Args:
        logits: ``[rows, vocab]`` float32; rows may be strided.
        top_k: ``[rows]`` integers, 0 keeps all.
        top_p: ``[rows]`` floats in (0, 1], 1 keeps all.
        block, cap: powers of two, the pass width and the most tokens a search holds in
            registers (tests use small ones to reach every path on small vocabularies).

    Returns:
        A new contiguous float32 ``[rows, vocab]`` tensor.
    """
    logits, top_k, top_p = _checked(logits, top_k, top_p)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    _launch(logits, top_k, top_p, out, block, cap)
    return out


def top_k_top_p_cut_triton(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    block: int | None = None,
    cap: int | None = None,
) -> torch.Tensor:
    """Each row's cut rather than the masked row: ``[rows, 2]`` int32, the boundary's key
    (``float_key``) and the index of its last tie kept; a token stays if ``kept`` says so.
    One pass over the row fewer, for a caller that reads the row anyway (the sampler's
    draw). Arguments as ``top_k_top_p_triton``'s."""
    logits, top_k, top_p = _checked(logits, top_k, top_p)
    cut = torch.empty((logits.shape[0], 2), dtype=torch.int32, device=logits.device)
    _launch(logits, top_k, top_p, cut, block, cap)
    return cut


def _checked(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(
            f"logits must be [rows, vocab] float32, got {tuple(logits.shape)} {logits.dtype}"
        )
    rows = logits.shape[0]
    if top_k.shape != (rows,) or top_p.shape != (rows,):
        raise ValueError(
            f"top_k and top_p must be [{rows}], got {tuple(top_k.shape)} and {tuple(top_p.shape)}"
        )
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return logits, top_k.contiguous(), top_p.contiguous()  # the kernel reads them by row


def _launch(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    out: torch.Tensor,
    block: int | None,
    cap: int | None,
) -> None:
    """One program a row; ``out`` is the masked rows (``[rows, vocab]`` float32) or the cuts
    (``[rows, 2]`` int32)."""
    block = block or _BLOCK
    cap = cap or _CAP
    for name, size in (("block", block), ("cap", cap)):
        if size < 2 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two of at least 2, got {size}")
    if cap > _MAX_CAP:
        raise ValueError(f"cap must be at most {_MAX_CAP} (its fixed-point masses), got {cap}")
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return
    scratch = torch.empty((rows, 2 * cap + 1), dtype=torch.int32, device=logits.device)
    write = out.dtype == torch.float32
    _top_k_top_p_kernel[(rows,)](
        logits,
        out,
        top_k,
        top_p,
        scratch,
        logits.stride(0),
        out.stride(0),
        vocab,
        BLOCK=block,
        CAP=cap,
        VALUE_SPAN=_VALUE_SPAN,
        VALUE_STEPS=_VALUE_STEPS,
        WRITE=write,
        num_warps=_NUM_WARPS,
    )
