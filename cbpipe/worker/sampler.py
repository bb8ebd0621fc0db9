"""Sampling on the device: greedy, temperature, top-k, top-p, with per-request seeds.

Randomness comes from a counter-based hash of ``(seed, output_index, token_id)`` rather than a
generator with state, so a request's draw for its i-th output token is the same whatever else
shares its batch, in sync and async mode, and on any device. The hash is computed in int64
with 32-bit values and multipliers below 2**31, so no product overflows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D
_MUL2 = 0x5F356495
_TOKEN_MUL = 0x2545F491


@dataclass
class SamplingInputs:
    """Per-sequence sampling parameters, all ``[num_seqs]`` device tensors."""

    temperature: torch.Tensor  # float32; 0 means greedy
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int32; 0 keeps all
    seed: torch.Tensor  # int64
    output_index: torch.Tensor  # int32
    all_greedy: bool
    needs_top_k_top_p: bool


def sample(logits: torch.Tensor, inputs: SamplingInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Return sampled ids ``[num_seqs]`` (int64) and their log-probabilities (float32)."""
    logits = logits.float()  # [num_seqs, vocab]
    greedy = logits.argmax(dim=-1)
    if inputs.all_greedy:
        ids = greedy
    else:
        temperature = inputs.temperature.clamp_min(1e-6)[:, None]
        scaled = logits / temperature
        if inputs.needs_top_k_top_p:
            scaled = _apply_top_k_top_p(scaled, inputs.top_k, inputs.top_p)
        # Gumbel-max: argmax(log p + Gumbel) is a sample from p; -log(E) with E ~ Exp(1).
        uniform = _uniform(inputs.seed, inputs.output_index, logits.shape[-1])
        gumbel = -torch.log(-torch.log(uniform))
        sampled = (scaled + gumbel).argmax(dim=-1)
        ids = torch.where(inputs.temperature == 0, greedy, sampled)
    # log p = logit - logsumexp: one reduction over the vocabulary instead of a whole
    # log-softmax written out and gathered from (the 8B decode step spent 31 us on it).
    chosen = logits.gather(-1, ids[:, None])[:, 0]
    return ids, chosen - torch.logsumexp(logits, dim=-1)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.long(), vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the mass before it already reaches top_p; the first always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


def _uniform(seed: torch.Tensor, output_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[num_seqs, vocab]`` floats in (0, 1), a pure function of seed, index and token id."""
    seed = seed.long()
    key = _mix32((seed & _MASK32) ^ _mix32((seed >> 32) & _MASK32))
    key = _mix32(key ^ _mix32(output_index.long() & _MASK32))  # [S]
    token = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    x = _mix32(key[:, None] ^ ((token * _TOKEN_MUL) & _MASK32)[None, :])
    x = _mix32(x ^ key[:, None])
    # 24 random bits, centred in their interval so 0 and 1 never occur.
    return ((x >> 8).float() + 0.5) / float(1 << 24)
