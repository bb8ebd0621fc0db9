"""The torch path: gather each sequence's pages, then SDPA, or plain math where SDPA cannot.

Used on the CPU, and on CUDA with ``--attention-backend torch`` / ``--prefill-attention-backend
torch``. Gather indices and masks are built once per step (``GatheredRows.decode`` and
``.prefill``) and shared by every layer; a model with sliding windows gets one mask per
distinct window. Soft-capping and attention sinks need the scores themselves, which SDPA does
not expose, so layers with either take ``attend_math`` (the float32 softmax of transformers'
eager attention); every other layer keeps SDPA.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cbpipe.worker.attention.variant import AttentionVariant

# cuDNN's attention is left out: it plans a graph per new shape, and the key length changes at
# every decode step.
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def gather_index(block_tables: torch.Tensor, max_context_len: int, block_size: int):  # type: ignore[no-untyped-def]
    """``(key_pos [max_k], kv_index [S, max_k])``: flat cache index of each key position.

    Key position l of seq s lives at ``block_tables[s, l // bs] * bs + l % bs``.
    """
    key_pos = torch.arange(max_context_len, device=block_tables.device)
    kv_index = block_tables[:, key_pos // block_size].long() * block_size + key_pos % block_size
    return key_pos, kv_index


@dataclass
class GatheredRows:
    """Sequences attended together, their rows gathered to ``[num_seqs, max_q]``.

    ``masks`` maps each sliding window of the model (None: no window) to ``[num_seqs, 1,
    group_size * max_q, max_k]``, True where the row may attend the key; query rows inside a
    KV group are ordered (query head within the group, row), see ``attend_gathered``.
    """

    row_index: torch.Tensor  # [num_seqs, max_q] rows of the packed step (repeats pad short seqs)
    kv_index: torch.Tensor  # [num_seqs, max_k] flat cache index of each key position
    masks: dict[int | None, torch.Tensor]
    # Where the padded result goes: out[first_row + j] = result[seq[j], offset[j]].
    first_row: int
    seq: torch.Tensor
    offset: torch.Tensor

    @classmethod
    def decode(
        cls,
        kv_index: torch.Tensor,  # [num_rows, max_k]
        key_pos: torch.Tensor,  # [max_k]
        context_lens: torch.Tensor,  # [num_rows]
        kv_group_size: int,
        windows: Iterable[int | None],
    ) -> GatheredRows:
        """Rows ``[0, num_rows)``, one per sequence, at position ``context_len - 1``."""
        rows = torch.arange(kv_index.shape[0], device=kv_index.device)
        lens = context_lens.long()[:, None]  # [num_rows, 1]
        masks = {}
        for window in set(windows):
            visible = key_pos[None, :] < lens  # [num_rows, max_k]
            if window is not None:
                visible = visible & (key_pos[None, :] >= lens - window)
            mask = visible[:, None, None, :].expand(-1, -1, kv_group_size, -1)
            masks[window] = mask.contiguous()  # as SDPA's fused kernels want it
        return cls(rows[:, None], kv_index, masks, 0, rows, torch.zeros_like(rows))

    @classmethod
    def prefill(
        cls,
        kv_index: torch.Tensor,  # [P, max_k]
        key_pos: torch.Tensor,  # [max_k]
        positions: torch.Tensor,  # [num_tokens] of the whole step
        query_start: torch.Tensor,  # [P + 1]; query_start[0] == first_row
        first_row: int,
        max_query_len: int,
        kv_group_size: int,
        windows: Iterable[int | None],
    ) -> GatheredRows:
        """Sequences of several rows (prefill chunks): rows ``[first_row, num_tokens)``."""
        device = positions.device
        starts = query_start[:-1].long()  # [P]
        lengths = query_start[1:].long() - starts
        offsets = torch.arange(max_query_len, device=device)  # [max_q]
        # Rows past a seq's chunk repeat its last row: valid input, output discarded.
        rows = starts[:, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)
        row_pos = positions[rows][:, :, None]  # [P, max_q, 1]
        masks = {}
        for window in set(windows):
            visible = key_pos[None, None, :] <= row_pos  # causal within the cache
            if window is not None:
                visible = visible & (key_pos[None, None, :] > row_pos - window)
            masks[window] = visible[:, None].repeat(1, 1, kv_group_size, 1)
        row_ids = torch.arange(first_row, int(positions.shape[0]), device=device)
        seq = torch.searchsorted(starts, row_ids, right=True) - 1
        return cls(rows, kv_index, masks, first_row, seq, row_ids - starts[seq])

    def attend(
        self,
        variant: AttentionVariant,
        query: torch.Tensor,  # [num_tokens, heads, head_dim], the whole step
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,  # [num_tokens, heads, head_dim]: this group's rows are written
    ) -> None:
        mask = self.masks.get(variant.sliding_window)
        if mask is None:
            raise ValueError(
                f"no mask for sliding window {variant.sliding_window}: the step was built "
                f"for windows {sorted(self.masks, key=str)}"
            )
        padded = attend_gathered(
            query, k_cache, v_cache, self.row_index, self.kv_index, mask, variant
        )  # [S, max_q, H, D]
        out[self.first_row : self.first_row + self.seq.shape[0]] = padded[self.seq, self.offset]


def attend_gathered(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_index: torch.Tensor,  # [S, max_q]
    kv_index: torch.Tensor,  # [S, max_k]
    mask: torch.Tensor,  # [S, 1, G * max_q, max_k] bool
    variant: AttentionVariant,
) -> torch.Tensor:
    """Attention for one group of sequences; returns ``[num_seqs, max_q, heads, head_dim]``.

    Grouped-query attention is folded into the query length: the ``G`` query heads that share
    a KV head become ``G`` times as many query rows of that head, so no backend has to
    support GQA and no KV is repeated.
    """
    num_seqs, max_q = row_index.shape
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    group_size = q.shape[1] // kv_heads
    q_g = q[row_index]  # [S, max_q, H, D]
    q_g = q_g.view(num_seqs, max_q, kv_heads, group_size, head_dim).permute(0, 2, 3, 1, 4)
    q_g = q_g.reshape(num_seqs, kv_heads, group_size * max_q, head_dim)  # rows: (g, j)
    k_g = k_cache[kv_index].transpose(1, 2).to(q.dtype)  # [S, KVH, max_k, D]
    v_g = v_cache[kv_index].transpose(1, 2).to(q.dtype)
    if variant.softcap is None and variant.sinks is None:
        with sdpa_kernel(_BACKENDS):
            out = F.scaled_dot_product_attention(
                q_g, k_g, v_g, attn_mask=mask, scale=variant.scaling
            )
    else:
        sinks = None
        if variant.sinks is not None:  # [H] -> one per folded row: [1, KVH, G * max_q, 1]
            sinks = variant.sinks.view(kv_heads, group_size, 1).expand(-1, -1, max_q)
            sinks = sinks.reshape(1, kv_heads, group_size * max_q, 1)
        out = attend_math(q_g, k_g, v_g, mask, variant.scaling, variant.softcap, sinks)
    out = out.view(num_seqs, kv_heads, group_size, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs, max_q, kv_heads * group_size, head_dim)


def attend_math(
    q: torch.Tensor,  # [..., rows, D]
    k: torch.Tensor,  # [..., keys, D]
    v: torch.Tensor,  # [..., keys, D]
    mask: torch.Tensor,  # [..., rows, keys] bool, broadcast
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [..., rows, 1] logits, broadcast
) -> torch.Tensor:
    """Softmax attention spelled out, as transformers' eager attention computes it: scores,
    soft-cap, mask, then a float32 softmax (with each row's sink logit, whose weight is
    dropped). A row that sees no key gets zeros. Returns ``[..., rows, D]`` in q's dtype."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    top = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)
    weights = torch.exp(scores - top)
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).tiny)
    if sinks is not None:
        weights = weights[..., :-1]
    return torch.matmul(weights.to(v.dtype), v)
