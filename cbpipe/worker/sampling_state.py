"""Per-request sampling state on the device: output token counts, seen tokens, logit bias.

The penalties and the logit bias of a request need what it has seen and emitted so far, and
the device is the first to know each sampled token (the scheduler learns it one or two steps
later). So the state lives on the device, one row per request, indexed by the sequence's
``request_row`` (its block-table row, stable while it runs), plus one spare row that padding
rows, masked-out entries and rows nobody reads are sent to, so that they never touch a real
request's row:

- ``output_counts`` ``[rows + 1, vocab]`` int32: how often each token was output (frequency
  and presence penalties, which count outputs only, as OpenAI and vLLM define them);
- ``seen`` ``[rows + 1, vocab]`` bool: the token occurs in the prompt or the outputs (the
  repetition penalty, as transformers' ``RepetitionPenaltyLogitsProcessor`` and vLLM have it);
- ``bias`` ``[rows + 1, vocab]`` float32: the request's logit bias, ``-inf`` where a token is
  banned (EOS and stop tokens while it is short of ``min_tokens``);
- ``num_counted`` ``[rows + 1]`` int32: positions below this are counted in the row.

Memory: 9 bytes per (row, token). Llama 3's vocabulary of 128256 with ``--max-num-seqs 256``
is 257 x 128256 x 9 = 297 MB (38 MB at 32 sequences), allocated before the KV cache is sized.

A row is cleared in whatever step a sequence takes it; the rest is maintained in FULL steps
only: every step that holds a request needing the state is FULL (the scheduler's rule), so
no update a request needs is ever skipped. A request that needs none still has its row read
when a FULL step samples it beside one that does (the bias is added to every row), so its
row must hold nothing of its previous owner's: zeros, whatever mode its first step had. Per
step, on the compute stream, in this order:

1. ``reset`` the rows of sequences that took them in this step (the slot's ``resets_row``:
   new, or resumed after a preemption; from position 0, or after a cached prefix, whose rows
   are never counted: requests that need the counts or the bias read no cached blocks), in
   every step, FULL or not;
2. ``apply_masks``: each structured-output mask of the step rewrites its row's bias whole:
   0 where the mask allows a token, ``-inf`` elsewhere (the scheduler sends a mask, and the
   row's logit-bias entries after it, in every step in which such a request samples, so
   nothing of an earlier step's mask remains);
3. ``apply_bias``: the step's logit-bias entries, in order (the last entry for a (row, token)
   wins);
4. ``count_inputs``: each row of the step whose position is at or past its row's
   ``num_counted`` is a token the row has not seen yet: it is marked seen and, at or past the
   prompt's length (an output recomputed after a preemption), counted as an output;
5. the logits are processed and sampled (``sampler.sample_full``);
6. ``count_sampled``: each sequence that samples (its rows reach the end of its tokens,
   ``context_len == num_prompt_tokens + output_index``) counts its sampled token, and
   ``num_counted`` moves past it.

Why the counts are right:

- Steps run in launch order on one compute stream, and each step's sampled token is counted
  (6) before the next step runs; the decode row that carries that token over (an input the
  scheduler has not even seen yet) sits at position ``num_counted - 1``, so (4) skips it. With
  three steps in flight nothing changes: the device never waits for the scheduler, and the
  order of the updates is the order of the tokens.
- A row's input at a position not yet counted is a token the row has not counted since its
  reset: a prompt token (any chunk, including a chunk of one row, which may run as a decode
  graph) or an output being recomputed after a preemption (counted as an output). So after a
  recompute the row holds exactly what it held before the preemption.
- A request that finished (or was cancelled, or preempted) while it still had rows in steps
  in flight updates its old row in those steps; whoever takes that row next takes it in a
  later step, which resets the row first. A preempted request resumes, in a step planned
  after the preemption, in whichever row it gets, and resets it.
- A sequence that does not sample (a prompt chunk before the last) counts its rows in (4)
  but not the token sampled from its last row, which nobody reads.
- Padding rows of a graph bucket, and bias entries past the step's count, go to the spare
  row, which no request owns and whose values no one reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingState:
    output_counts: torch.Tensor  # [rows + 1, vocab] int32
    seen: torch.Tensor  # [rows + 1, vocab] bool
    bias: torch.Tensor  # [rows + 1, vocab] float32
    num_counted: torch.Tensor  # [rows + 1] int32

    @classmethod
    def allocate(cls, num_rows: int, vocab: int, device: torch.device) -> SamplingState:
        """State for ``num_rows`` requests (``--max-num-seqs``) and the spare row."""
        shape = (num_rows + 1, vocab)
        return cls(
            output_counts=torch.zeros(shape, dtype=torch.int32, device=device),
            seen=torch.zeros(shape, dtype=torch.bool, device=device),
            bias=torch.zeros(shape, dtype=torch.float32, device=device),
            num_counted=torch.zeros(num_rows + 1, dtype=torch.int32, device=device),
        )

    @staticmethod
    def nbytes(num_rows: int, vocab: int) -> int:
        return (num_rows + 1) * (vocab * (4 + 1 + 4) + 4)

    @property
    def vocab(self) -> int:
        return self.bias.shape[1]

    @property
    def spare_row(self) -> int:
        return self.bias.shape[0] - 1

    def reset(self, rows: torch.Tensor) -> None:
        """Clear ``rows`` (``[n]`` int64) for the requests that took them in this step."""
        for table in (self.output_counts, self.seen, self.bias):
            table.index_fill_(0, rows, 0)
        self.num_counted.index_fill_(0, rows, 0)

    def apply_masks(
        self,
        rows: torch.Tensor,  # [n] request rows, any integer dtype
        masks: torch.Tensor,  # [n, words] int32: bit t % 32 of word t // 32 allows token t
    ) -> None:
        """Set each row's bias to 0 where its mask allows a token and ``-inf`` elsewhere;
        tokens past the mask's bits (a head wider than the vocabulary) are banned."""
        n, words = masks.shape
        shifts = torch.arange(32, device=masks.device, dtype=torch.int32)
        bits = (masks[:, :, None] >> shifts) & 1  # [n, words, 32]
        width = min(words * 32, self.vocab)
        allowed = torch.zeros(n, self.vocab, dtype=torch.bool, device=masks.device)
        allowed[:, :width] = bits.view(n, words * 32)[:, :width].bool()
        banned = torch.full_like(allowed, float("-inf"), dtype=self.bias.dtype)
        self.bias.index_copy_(0, rows.long(), banned.masked_fill_(allowed, 0.0))

    def apply_bias(
        self,
        rows: torch.Tensor,  # [n] request rows, any integer dtype
        token_ids: torch.Tensor,  # [n]
        values: torch.Tensor,  # [n] float32: the bias from now on (-inf bans)
        valid: torch.Tensor | None = None,  # [n] bool: entries to apply, None for all
    ) -> None:
        """Set ``bias[row, token] = value`` for each entry, in order: of several entries for
        one (row, token) the last wins. Token ids outside the vocabulary can never be
        sampled, so their entries change nothing and are dropped."""
        vocab = self.vocab
        rows, token_ids = rows.long(), token_ids.long()
        inside = (token_ids >= 0) & (token_ids < vocab)
        if valid is not None:
            inside = inside & valid
        rows = torch.where(inside, rows, self.spare_row)
        token_ids = torch.where(inside, token_ids, 0)
        keys = rows * vocab + token_ids  # [n] flat indices
        sorted_keys, order = torch.sort(keys, stable=True)
        # The last of each run of equal keys is the entry that came last.
        last = torch.ones_like(sorted_keys, dtype=torch.bool)
        last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
        spare_key = self.spare_row * vocab
        winners = torch.where(last, sorted_keys, spare_key)
        self.bias.view(-1).scatter_(0, winners, values.float()[order])

    def count_inputs(
        self,
        rows: torch.Tensor,  # [tokens] request row of each token row (spare for padding)
        token_ids: torch.Tensor,  # [tokens] int64, after carry-over
        positions: torch.Tensor,  # [tokens]
        num_prompt_tokens: torch.Tensor,  # [tokens] of each row's sequence
    ) -> None:
        """Mark the rows' tokens not yet counted as seen, and those past the prompt (outputs
        recomputed after a preemption) as outputs. On CUDA one kernel
        (``kernels/state_counts.py``) where these torch operations are a dozen."""
        if self.seen.is_cuda:
            from cbpipe.worker.kernels.state_counts import count_inputs_triton

            count_inputs_triton(
                self.seen, self.output_counts, self.num_counted, rows, token_ids, positions,
                num_prompt_tokens,
            )  # fmt: skip
            return
        self.count_inputs_reference(rows, token_ids, positions, num_prompt_tokens)

    def count_inputs_reference(
        self,
        rows: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        num_prompt_tokens: torch.Tensor,
    ) -> None:
        """``count_inputs`` in torch: the definition, and the path off CUDA."""
        new = positions >= self.num_counted[rows]
        vocab = self.vocab
        spare = self.spare_row * vocab
        flat = rows * vocab + token_ids
        self.seen.view(-1).scatter_(0, torch.where(new, flat, spare), True)
        is_output = new & (positions >= num_prompt_tokens)
        ones = torch.ones_like(flat, dtype=torch.int32)
        self.output_counts.view(-1).scatter_add_(0, torch.where(is_output, flat, spare), ones)

    def count_sampled(
        self,
        rows: torch.Tensor,  # [seqs] request row of each sequence (spare for padding)
        sampled_ids: torch.Tensor,  # [seqs] int64
        context_lens: torch.Tensor,  # [seqs] KV length once the step's rows are written
        samples: torch.Tensor,  # [seqs] bool: the sequence's sampled token is an output
    ) -> None:
        """Count each sampled output as seen and output, and move ``num_counted`` past what
        each sequence has counted. On CUDA one kernel, as ``count_inputs``."""
        if self.seen.is_cuda:
            from cbpipe.worker.kernels.state_counts import count_sampled_triton

            count_sampled_triton(
                self.seen, self.output_counts, self.num_counted, rows, sampled_ids,
                context_lens, samples,
            )  # fmt: skip
            return
        self.count_sampled_reference(rows, sampled_ids, context_lens, samples)

    def count_sampled_reference(
        self,
        rows: torch.Tensor,
        sampled_ids: torch.Tensor,
        context_lens: torch.Tensor,
        samples: torch.Tensor,
    ) -> None:
        """``count_sampled`` in torch: the definition, and the path off CUDA."""
        vocab = self.vocab
        flat = torch.where(samples, rows * vocab + sampled_ids, self.spare_row * vocab)
        self.seen.view(-1).scatter_(0, flat, True)
        ones = torch.ones_like(flat, dtype=torch.int32)
        self.output_counts.view(-1).scatter_add_(0, flat, ones)
        # The sampled token sits at position context_len; a chunk that does not sample has
        # counted its rows, up to context_len.
        counted = torch.where(
            samples, context_lens + 1, torch.maximum(self.num_counted[rows], context_lens)
        )
        self.num_counted.index_copy_(0, rows, counted.to(torch.int32))
