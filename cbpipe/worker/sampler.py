"""Sampling on the device: greedy, temperature, and the full processing chain, seeded.

Three samplers, one per ``SamplingMode``: ``cbpipe::greedy_sample`` (argmax of the raw logits
and its log-probability), ``sample`` (temperature only; greedy rows where it is 0) and
``sample_full`` (logit bias and bans, penalties, temperature, min_p, top-k, top-p, top
alternatives). ``sample_full`` of a row that uses none of its processing draws exactly what
``sample`` draws for it, so a seeded request gets the same tokens whatever shares its step.
On CUDA both run as Triton kernels behind ops (``kernels/full_sample.py``, and
``kernels/truncation.py`` for top-k/top-p); ``sample_reference`` and ``sample_full_reference``
are the same in plain torch, the path off CUDA and what the kernels are tested against.

Randomness comes from a counter-based hash of ``(seed, output_index, token_id)`` rather than a
generator with state, so a request's draw for its i-th output token is the same whatever else
shares its batch, in sync and async mode, and on any device. Each row's key is mixed in int64
(32-bit values, multipliers below 2**31: no product overflows), each token's draw in int32
with the same bits (products wrapping modulo 2**32, shifts masked to a logical shift's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from cbpipe.protocol.sampling import MAX_TOP_LOGPROBS

_MASK32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D
_MUL2 = 0x5F356495
_TOKEN_MUL = 0x2545F491


@dataclass
class SamplingInputs:
    """Per-sequence sampling parameters, all ``[num_seqs]`` device tensors."""

    temperature: torch.Tensor  # float32; 0 means greedy
    seed: torch.Tensor  # int64
    output_index: torch.Tensor  # int32
    all_greedy: bool


def sample(logits: torch.Tensor, inputs: SamplingInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Return sampled ids ``[num_seqs]`` (int64) and their log-probabilities (float32)."""
    if inputs.all_greedy:  # the logits as the model gave them: the kernel reads bf16 itself
        ids, logprobs = torch.ops.cbpipe.greedy_sample(logits)
        return ids, logprobs
    if logits.is_cuda:
        return sample_kernels(logits, inputs)
    return sample_reference(logits, inputs)


def sample_reference(
    logits: torch.Tensor, inputs: SamplingInputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample``'s sampled rows in plain torch: what the CUDA kernels are held to."""
    logits = logits.float()  # [num_seqs, vocab]
    pieces = _pieces(logits)
    piece_max, row_max, greedy = _max_and_argmax(pieces)
    temperature = inputs.temperature.clamp_min(1e-6)[:, None]
    scaled = logits / temperature
    # Gumbel-max: argmax(log p + Gumbel) is a sample from p; -log(E) with E ~ Exp(1).
    uniform = _uniform(inputs.seed, inputs.output_index, logits.shape[-1])
    gumbel = -torch.log(-torch.log(uniform))
    sampled = _max_and_argmax(_pieces(scaled + gumbel))[2]
    ids = torch.where(inputs.temperature == 0, greedy, sampled)
    chosen = logits.gather(-1, ids[:, None])[:, 0]
    # log p = logit - logsumexp, the logsumexp from the same pieces as the maximum, instead of
    # a whole log-softmax written out and gathered from.
    return ids, chosen - _logsumexp(pieces, piece_max, row_max)


def sample_kernels(
    logits: torch.Tensor, inputs: SamplingInputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` through the kernels ``sample_full`` runs, without their processing: a row
    draws the same token either way."""
    scaled, stats = torch.ops.cbpipe.sample_prepare(logits, inputs.temperature, [])
    ids, logprobs, _ = torch.ops.cbpipe.sample_draw(
        logits, scaled, stats, inputs.temperature, inputs.seed, inputs.output_index, None, None
    )
    return ids, logprobs


@dataclass
class FullSamplingInputs:
    """Per-sequence parameters of ``sample_full``, ``[num_seqs]`` device tensors, with each
    sequence's row in the per-request state (``sampling_state.SamplingState``)."""

    temperature: torch.Tensor  # float32; 0 means greedy (argmax of the processed logits)
    top_p: torch.Tensor  # float32; 1 keeps all
    top_k: torch.Tensor  # int32; 0 keeps all
    min_p: torch.Tensor  # float32; 0 keeps all
    presence_penalty: torch.Tensor  # float32
    frequency_penalty: torch.Tensor  # float32
    repetition_penalty: torch.Tensor  # float32; 1 changes nothing
    seed: torch.Tensor  # int64
    output_index: torch.Tensor  # int32
    rows: torch.Tensor  # int64 request rows (the spare row for padding)
    truncation: bool  # some row has top-k or top-p: sort the rows


class FullSample(NamedTuple):
    ids: torch.Tensor  # [num_seqs] int64
    logprobs: torch.Tensor  # [num_seqs] float32, of the raw distribution
    lse: torch.Tensor  # [num_seqs] float32, the raw logits' logsumexp (``top_alternatives``)


def sample_full(
    logits: torch.Tensor,  # [num_seqs, vocab]
    bias: torch.Tensor,  # [state rows, vocab] float32
    output_counts: torch.Tensor,  # [state rows, vocab] int32
    seen: torch.Tensor,  # [state rows, vocab] bool
    inputs: FullSamplingInputs,
) -> FullSample:
    """Sample with every per-request feature, in vLLM's order: logit bias (and bans), the
    penalties, temperature, min_p, top-k, top-p, then the seeded Gumbel-max draw of
    ``sample``; greedy rows take the argmax of the processed logits. Log-probabilities are
    those of the raw logits.

    On CUDA two passes over the vocabulary in Triton (``kernels/full_sample.py``), around
    the top-k/top-p op; elsewhere ``sample_full_reference``, which defines the result.

    The top alternatives are the caller's, from ``top_alternatives(logits.float(), lse)``
    after this returns: a flag read here would be a guard, and dynamo would trace this
    function once more for each of its values, at every start-up.

    Pure (the state tensors are only read), so ``torch.compile`` fuses what is left around
    the kernels' ops.
    """
    if logits.is_cuda:
        return sample_full_kernels(logits, bias, output_counts, seen, inputs)
    return sample_full_reference(logits, bias, output_counts, seen, inputs)


def sample_full_kernels(
    logits: torch.Tensor,
    bias: torch.Tensor,
    output_counts: torch.Tensor,
    seen: torch.Tensor,
    inputs: FullSamplingInputs,
) -> FullSample:
    """``sample_full`` through the kernels' ops (which run on CPU tensors too, under Triton's
    interpreter: the tests)."""
    state = [
        bias, output_counts, seen, inputs.rows, inputs.presence_penalty,
        inputs.frequency_penalty, inputs.repetition_penalty,
    ]  # fmt: skip
    scaled, stats = torch.ops.cbpipe.sample_prepare(logits, inputs.temperature, state)
    min_p, cut = inputs.min_p, None
    if inputs.truncation:  # top-k and top-p see what min-p keeps; the draw applies their cut
        torch.ops.cbpipe.apply_min_p_(scaled, stats, min_p)
        cut, min_p = torch.ops.cbpipe.top_k_top_p_cut(scaled, inputs.top_k, inputs.top_p), None
    ids, logprobs, lse = torch.ops.cbpipe.sample_draw(
        logits, scaled, stats, inputs.temperature, inputs.seed, inputs.output_index, min_p, cut
    )
    return FullSample(ids, logprobs, lse)


def sample_full_reference(
    logits: torch.Tensor,
    bias: torch.Tensor,
    output_counts: torch.Tensor,
    seen: torch.Tensor,
    inputs: FullSamplingInputs,
) -> FullSample:
    """``sample_full`` in plain torch: what the CUDA kernels are held to."""
    x = logits.float()  # [num_seqs, vocab]
    pieces = _pieces(x)
    piece_max, row_max, _ = _max_and_argmax(pieces)
    lse = _logsumexp(pieces, piece_max, row_max)  # [num_seqs], raw
    rows = inputs.rows
    processed = apply_penalties(
        x + bias[rows],
        output_counts[rows],
        seen[rows],
        presence=inputs.presence_penalty,
        frequency=inputs.frequency_penalty,
        repetition=inputs.repetition_penalty,
    )
    greedy = _max_and_argmax(_pieces(processed))[2]
    # As ``sample`` computes it, so a row without processing draws what it draws there.
    scaled = processed / inputs.temperature.clamp_min(1e-6)[:, None]
    scaled = apply_min_p(scaled, inputs.min_p)
    if inputs.truncation:
        scaled = _apply_top_k_top_p(scaled, inputs.top_k, inputs.top_p)
    uniform = _uniform(inputs.seed, inputs.output_index, x.shape[-1])
    gumbel = -torch.log(-torch.log(uniform))
    sampled = _max_and_argmax(_pieces(scaled + gumbel))[2]
    ids = torch.where(inputs.temperature == 0, greedy, sampled)
    logprobs = x.gather(-1, ids[:, None])[:, 0] - lse
    return FullSample(ids, logprobs, lse)


def apply_penalties(
    logits: torch.Tensor,  # [rows, vocab] float32
    output_counts: torch.Tensor,  # [rows, vocab] int32: outputs so far
    seen: torch.Tensor,  # [rows, vocab] bool: in the prompt or the outputs
    *,
    presence: torch.Tensor,  # [rows]
    frequency: torch.Tensor,  # [rows]
    repetition: torch.Tensor,  # [rows]
) -> torch.Tensor:
    """vLLM's penalties: a seen token's logit is divided by ``repetition`` if positive and
    multiplied by it otherwise (transformers' ``RepetitionPenaltyLogitsProcessor``); then
    OpenAI's ``logit - frequency * count - presence * (count > 0)`` over the outputs.
    Neutral values (1, 0, 0) leave every logit exactly as it was."""
    rep = repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    counts = output_counts.float()
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (output_counts > 0).float()


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask the tokens whose probability is below ``min_p`` times the top token's (as
    transformers' ``MinPLogitsWarper``: ``p < min_p * p_max`` is ``exp(x - x_max) < min_p``);
    ``min_p`` 0 masks nothing."""
    row_max = logits.amax(dim=-1, keepdim=True)
    drop = (logits - row_max).exp() < min_p[:, None]
    return logits.masked_fill(drop, float("-inf"))


def top_alternatives(logits: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``MAX_TOP_LOGPROBS`` most likely tokens of each row, best first, as int32 ids and
    their log-probabilities ``logit - lse`` (``[rows, MAX_TOP_LOGPROBS]`` each; a vocabulary
    smaller than that is padded with id 0 at ``-inf``)."""
    k = min(MAX_TOP_LOGPROBS, logits.shape[-1])
    values, ids = torch.topk(logits, k, dim=-1)
    values = values - lse[:, None]
    if k < MAX_TOP_LOGPROBS:
        values = torch.nn.functional.pad(values, (0, MAX_TOP_LOGPROBS - k), value=float("-inf"))
        ids = torch.nn.functional.pad(ids, (0, MAX_TOP_LOGPROBS - k))
    return ids.to(torch.int32), values


def prompt_logprobs(
    logits: torch.Tensor,  # [rows, vocab]
    targets: torch.Tensor,  # [rows] int64: the token that follows each row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's log-probability of its target, and its top alternatives (raw logits)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)  # [rows]
    target_logprobs = x.gather(-1, targets[:, None])[:, 0] - lse
    top_ids, top_logprobs = top_alternatives(x, lse)
    return target_logprobs, top_ids, top_logprobs


@torch.library.custom_op("cbpipe::greedy_sample", mutates_args=())
def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first argmax (int64) and its log-probability (float32), ``[rows]`` each.

    On CUDA two Triton kernels that read the logits once (``kernels/greedy_sample.py``; what
    inductor made of the pieces below read them twice, 23 us for an 8B step's batch of 32);
    one opaque op, so ``torch.compile`` leaves them alone. Elsewhere plain torch.
    """
    if logits.is_cuda:
        from cbpipe.worker.kernels.greedy_sample import greedy_sample_triton

        return greedy_sample_triton(logits)
    return greedy_sample_reference(logits)


@greedy_sample.register_fake
def _greedy_sample_shape(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logits.shape[0]
    return (
        logits.new_empty(rows, dtype=torch.int64),
        logits.new_empty(rows, dtype=torch.float32),
    )


def greedy_sample_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cbpipe::greedy_sample`` in plain torch, float32: ``argmax`` (ties to the first index)
    and ``log_softmax`` there, as ``-log(sum(exp(x - max)))``."""
    x = logits.float()  # [rows, vocab]
    ids = x.argmax(dim=-1)
    row_max = x.gather(-1, ids[:, None])
    return ids, -(x - row_max).exp().sum(dim=-1).log()


# The sampled path's reductions over the vocabulary run on each row cut into up to this many
# equal pieces, then over the pieces: one program per row was all inductor gave an argmax, 32
# programs on an H200's 132 SMs for a batch of 32. In 64 pieces the two passes took a third
# of that; 128 pieces made the second pass dearer than the first saved (docs/PERFORMANCE.md).
# Greedy batches take ``cbpipe::greedy_sample`` instead, a kernel of our own.
_MAX_PIECES = 64
_MIN_PIECE = 1024


def _pieces(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, vocab]`` as ``[rows, pieces, vocab // pieces]``, without padding.

    The piece count is the largest divisor of the vocabulary up to ``_MAX_PIECES`` that keeps
    pieces ``_MIN_PIECE`` long (64 of 2004 for Llama 3's 128256; one for a prime vocabulary).
    """
    rows, vocab = x.shape
    count = next(
        (n for n in range(min(_MAX_PIECES, vocab // _MIN_PIECE), 1, -1) if vocab % n == 0), 1
    )
    return x.reshape(rows, count, vocab // count)


def _max_and_argmax(
    pieces: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each piece's maximum, and each row's maximum and its first index, as ``argmax`` has it.

    Ties go to the first index: ``max`` over a dimension returns a maximum's first index, so
    the first piece holding the row's maximum holds its first occurrence.
    """
    piece_max, piece_arg = pieces.max(dim=-1)  # [rows, pieces]
    row_max, best = piece_max.max(dim=-1)  # [rows]
    ids = best * pieces.shape[-1] + piece_arg.gather(-1, best[:, None])[:, 0]
    return piece_max, row_max, ids


def _logsumexp(
    pieces: torch.Tensor, piece_max: torch.Tensor, row_max: torch.Tensor
) -> torch.Tensor:
    """Each row's logsumexp from its pieces and their maxima (``[rows, pieces]``)."""
    # A piece that is all -inf would give -inf - -inf = nan; shifted by the lowest float
    # instead, its terms are exp(-inf) = 0.
    shift = piece_max.clamp_min(torch.finfo(pieces.dtype).min)
    piece_sum = (pieces - shift[..., None]).exp().sum(dim=-1)
    return row_max + (piece_sum * (piece_max - row_max[:, None]).exp()).sum(dim=-1).log()


# Opaque to the compiled sampler (one op inductor calls as it is; inside a CUDA graph
# capture its kernels are recorded like any others): inductor (torch 2.11) fails to generate
# the split scan it picks for the running mass over a 128 k vocabulary with dynamic shapes
# ("list indices must be integers or slices, not NoneType"), and on CUDA the op is a Triton
# kernel of its own. An op rather than a graph break, so that the sampler is still one graph,
# which a saved trace needs (``saved_traces.py``).
@torch.library.custom_op("cbpipe::top_k_top_p", mutates_args=())
def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to ``-inf``) what top-k and then top-p drop.

    On CUDA a kernel that finds each row's cut by bisection instead of sorting the row
    (``kernels/truncation.py``: a sort of 128 k logits a row was most of a sampled step's
    cost); elsewhere ``top_k_top_p_reference``. Both keep the same tokens but where float32
    rounding of the running mass decides: on a flat row of many tokens, a few at the cut.
    """
    if logits.is_cuda:
        from cbpipe.worker.kernels.truncation import top_k_top_p_triton

        return top_k_top_p_triton(logits, top_k, top_p)
    return top_k_top_p_reference(logits, top_k, top_p)


@_apply_top_k_top_p.register_fake
def _top_k_top_p_shape(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    return torch.empty_like(logits)


@torch.library.custom_op("cbpipe::top_k_top_p_cut", mutates_args=())
def _top_k_top_p_cut(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Each row's top-k/top-p cut, ``[rows, 2]`` int32: the boundary's order key and the
    index of its last tie kept (``kernels/truncation.py``'s ``kept`` applies it). The
    truncation kernel without its last pass, for the sampler's draw, which reads the row
    anyway; off CUDA (the kernels' tests) the cut of ``top_k_top_p_reference``'s mask."""
    if logits.is_cuda:
        from cbpipe.worker.kernels.truncation import top_k_top_p_cut_triton

        return top_k_top_p_cut_triton(logits, top_k, top_p)
    return top_k_top_p_cut_reference(logits, top_k, top_p)


@_top_k_top_p_cut.register_fake
def _top_k_top_p_cut_shape(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    return logits.new_empty((logits.shape[0], 2), dtype=torch.int32)


def top_k_top_p_cut_reference(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The cut of ``top_k_top_p_reference``'s mask: the lowest key it keeps and the highest
    index it keeps of that key (a row it leaves whole: the lowest key and the vocabulary's
    length, which keep every token, -inf ones too)."""
    keep = top_k_top_p_reference(logits, top_k, top_p) > float("-inf")
    bits = logits.contiguous().view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    lowest = torch.iinfo(torch.int32).min
    boundary = torch.where(keep, key, torch.iinfo(torch.int32).max).amin(-1)
    index = torch.arange(logits.shape[-1], device=logits.device)
    ties = keep & (key == boundary[:, None])
    last = torch.where(ties, index, -1).amax(-1)
    kept_all = keep.all(-1)  # -inf logits stay too: the cut that keeps everything
    boundary = torch.where(kept_all, lowest, boundary)
    last = torch.where(kept_all, logits.shape[-1], last)
    return torch.stack([boundary, last.to(torch.int32)], dim=-1).to(torch.int32)


def top_k_top_p_reference(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k and then top-p by sorting each row: the tokens by logit descending, ties by
    index (a stable sort); the first ``top_k`` stay (0 keeps all), then each whose mass before
    it, in the top-k set's softmax, is below ``top_p``.

    A row with ``top_k`` 0 (or at least the vocabulary) and ``top_p`` 1 keeps every value
    exactly: rounding in the running mass never drops its tail.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.long(), vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the mass before it already reaches top_p; the first always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The hash's mixing step on 32-bit values held in int64 (the per-row keys)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


def _mix32_bits(x: torch.Tensor) -> torch.Tensor:
    """``_mix32`` on the same 32 bits held in int32: products wrap modulo 2**32 as the
    masked int64 ones are reduced, and each shift is masked to the bits a logical shift
    keeps. Per token, where int64 arithmetic made the draws most of the sampler's time."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MUL1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _MUL2
    return x ^ ((x >> 16) & 0xFFFF)


def _row_keys(seed: torch.Tensor, output_index: torch.Tensor) -> torch.Tensor:
    """Each row's draw key, ``[num_seqs]`` int32 holding 32 hashed bits of its seed and
    output index."""
    seed = seed.long()
    key = _mix32((seed & _MASK32) ^ _mix32((seed >> 32) & _MASK32))
    key = _mix32(key ^ _mix32(output_index.long() & _MASK32))  # below 2**32
    return torch.where(key >= 1 << 31, key - (1 << 32), key).to(torch.int32)


def _uniform(seed: torch.Tensor, output_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[num_seqs, vocab]`` floats in (0, 1), a pure function of seed, index and token id."""
    key = _row_keys(seed, output_index)[:, None]
    token = torch.arange(vocab, device=seed.device, dtype=torch.int32) * _TOKEN_MUL
    x = _mix32_bits(key ^ token[None, :])
    x = _mix32_bits(x ^ key)
    # 23 random bits, centred in their interval so 0 and 1 never occur: k + 0.5 for k below
    # 2**23 is exact in float32, where with 24 bits 2**24 - 0.5 rounded up to 2**24 and u to
    # 1, whose Gumbel noise of +inf drew a token whatever its logit, a masked one included.
    return (((x >> 9) & 0x7FFFFF).float() + 0.5) / float(1 << 23)


# The sampled rows' passes on CUDA (``kernels/full_sample.py``), as ops inductor leaves whole.
@torch.library.custom_op("cbpipe::sample_prepare", mutates_args=())
def _sample_prepare(
    logits: torch.Tensor, temperature: torch.Tensor, state: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The processed logits over the temperature (float32) and each piece's figures.
    ``state``: ``[bias, output_counts, seen, rows, presence, frequency, repetition]``, or
    empty for rows without processing."""
    from cbpipe.worker.kernels.full_sample import prepare_triton

    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return prepare_triton(logits, temperature, tuple(state) if state else None)


@_sample_prepare.register_fake
def _sample_prepare_shape(
    logits: torch.Tensor, temperature: torch.Tensor, state: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    from cbpipe.worker.kernels.full_sample import num_pieces

    rows, vocab = logits.shape
    return (
        logits.new_empty((rows, vocab), dtype=torch.float32),
        logits.new_empty((5, rows, num_pieces(vocab)), dtype=torch.float32),
    )


@torch.library.custom_op("cbpipe::apply_min_p_", mutates_args=("scaled",))
def _apply_min_p_in_place(scaled: torch.Tensor, stats: torch.Tensor, min_p: torch.Tensor) -> None:
    """``apply_min_p`` on ``sample_prepare``'s output, in place."""
    from cbpipe.worker.kernels.full_sample import apply_min_p_triton

    apply_min_p_triton(scaled, stats, min_p)


@torch.library.custom_op("cbpipe::sample_draw", mutates_args=())
def _sample_draw(
    logits: torch.Tensor,
    scaled: torch.Tensor,
    stats: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    output_index: torch.Tensor,
    min_p: torch.Tensor | None,
    cut: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's token, its raw log-probability and the raw logsumexp; min-p applied first
    when given, top-k/top-p's cut (``top_k_top_p_cut``) when given."""
    from cbpipe.worker.kernels.full_sample import draw_triton

    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return draw_triton(logits, scaled, stats, temperature, seed, output_index, min_p, cut)


@_sample_draw.register_fake
def _sample_draw_shape(
    logits: torch.Tensor,
    scaled: torch.Tensor,
    stats: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    output_index: torch.Tensor,
    min_p: torch.Tensor | None,
    cut: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = logits.shape[0]
    return (
        logits.new_empty(rows, dtype=torch.int64),
        logits.new_empty(rows, dtype=torch.float32),
        logits.new_empty(rows, dtype=torch.float32),
    )
