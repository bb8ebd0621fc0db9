"""The sampling state's two per-step updates as one Triton kernel each.

``SamplingState.count_inputs`` and ``count_sampled`` (``cbpipe/worker/sampling_state.py``
defines them, in torch, and says why the counts are right) are a dozen small operations each:
gathers, comparisons, flat indices, a scatter and a scatter-add. In a FULL decode graph each
is a kernel of a microsecond or two, twenty-odd of them around the sampler; here each update
is one launch, a program per block of rows. The effects on every request's row are the
torch versions', exactly:

* ``seen`` is set by plain stores (setting a flag twice is setting it once);
* ``output_counts`` grows by atomic adds, since one call may count the same (row, token)
  twice (a prompt chunk that repeats a token, padding rows sent to the spare row);
* ``num_counted`` is stored once per sequence (``count_sampled`` has one entry a sequence;
  padding rows share the spare row, whose values no one reads).

Where the torch versions send an entry that counts nothing to the spare row's token 0, these
skip it, so the spare row differs; no request reads it for anything but padding. Grids follow
from host integers: no synchronisation, and a CUDA graph captures the launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbpipe.worker.kernels.jit import jit_varying

_BLOCK = 128


@jit_varying("n")
def _count_inputs_kernel(
    seen_ptr,  # [rows + 1, vocab] as uint8
    counts_ptr,  # [rows + 1, vocab] int32
    num_counted_ptr,  # [rows + 1] int32
    rows_ptr,  # [n] the state row of each token row
    tokens_ptr,  # [n]
    positions_ptr,  # [n]
    prompt_ptr,  # [n] the prompt length of each token row's sequence
    n,
    vocab,
    BLOCK: tl.constexpr,
):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    row = tl.load(rows_ptr + at, mask=inside, other=0).to(tl.int64)
    token = tl.load(tokens_ptr + at, mask=inside, other=0).to(tl.int64)
    position = tl.load(positions_ptr + at, mask=inside, other=0).to(tl.int64)
    prompt = tl.load(prompt_ptr + at, mask=inside, other=0).to(tl.int64)
    counted = tl.load(num_counted_ptr + row, mask=inside, other=0).to(tl.int64)
    new = inside & (position >= counted)
    flat = row * vocab + token
    tl.store(seen_ptr + flat, tl.full([BLOCK], 1, tl.uint8), mask=new)
    output = new & (position >= prompt)
    tl.atomic_add(counts_ptr + flat, tl.full([BLOCK], 1, tl.int32), mask=output, sem="relaxed")


@jit_varying("n")
def _count_sampled_kernel(
    seen_ptr,
    counts_ptr,
    num_counted_ptr,
    rows_ptr,  # [n] the state row of each sequence
    sampled_ptr,  # [n] its sampled token
    context_lens_ptr,  # [n]
    samples_ptr,  # [n] bool as uint8: the sampled token is an output
    n,
    vocab,
    BLOCK: tl.constexpr,
):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    row = tl.load(rows_ptr + at, mask=inside, other=0).to(tl.int64)
    token = tl.load(sampled_ptr + at, mask=inside, other=0).to(tl.int64)
    context = tl.load(context_lens_ptr + at, mask=inside, other=0).to(tl.int64)
    samples = inside & (tl.load(samples_ptr + at, mask=inside, other=0) != 0)
    flat = row * vocab + token
    tl.store(seen_ptr + flat, tl.full([BLOCK], 1, tl.uint8), mask=samples)
    tl.atomic_add(counts_ptr + flat, tl.full([BLOCK], 1, tl.int32), mask=samples, sem="relaxed")
    # The sampled token sits at position context_len; a chunk that does not sample has
    # counted its rows, up to context_len.
    old = tl.load(num_counted_ptr + row, mask=inside, other=0).to(tl.int64)
    counted = tl.where(samples, context + 1, tl.maximum(old, context))
    tl.store(num_counted_ptr + row, counted.to(tl.int32), mask=inside)


def count_inputs_triton(
    seen: torch.Tensor,
    output_counts: torch.Tensor,
    num_counted: torch.Tensor,
    rows: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    num_prompt_tokens: torch.Tensor,
) -> None:
    """``SamplingState.count_inputs`` on the state's tables, in place."""
    _launch(
        _count_inputs_kernel, seen, output_counts, num_counted,
        rows, token_ids, positions, num_prompt_tokens,
    )  # fmt: skip


def count_sampled_triton(
    seen: torch.Tensor,
    output_counts: torch.Tensor,
    num_counted: torch.Tensor,
    rows: torch.Tensor,
    sampled_ids: torch.Tensor,
    context_lens: torch.Tensor,
    samples: torch.Tensor,
) -> None:
    """``SamplingState.count_sampled`` on the state's tables, in place."""
    _launch(
        _count_sampled_kernel, seen, output_counts, num_counted,
        rows, sampled_ids, context_lens, samples.view(torch.uint8),
    )  # fmt: skip


def _launch(
    kernel: triton.JITFunction,
    seen: torch.Tensor,
    output_counts: torch.Tensor,
    num_counted: torch.Tensor,
    *per_row: torch.Tensor,  # [n] each, read by index
) -> None:
    """A program per ``_BLOCK`` rows over the state's tables (``seen`` as bytes)."""
    n = per_row[0].shape[0]
    if n:
        kernel[(triton.cdiv(n, _BLOCK),)](
            seen.view(torch.uint8), output_counts, num_counted,
            *(t.contiguous() for t in per_row), n, seen.shape[1], BLOCK=_BLOCK, num_warps=4,
        )  # fmt: skip
