"""Paged attention, plugged into unmodified transformers models through ``AttentionInterface``.

The model runs one packed sequence of all the step's rows (batch dimension 1). Each layer's
attention call writes the rows' keys and values into the paged cache, then attends each row to
its own sequence's cached keys, gathered through the block table. Rows of one query token
(decodes) are attended as one batch; sequences with several rows (prefill chunks) as another,
padded to the longest chunk, so a long chunk never pads the decode batch.

Plain torch, for correctness on the CPU and the GPU alike. The gather indices and masks are
built once per step in ``PagedStep.build`` and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "cbpipe_paged"
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class KVCache:
    """Per-layer key and value tensors, ``[num_blocks * block_size, num_kv_heads, head_dim]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0] // self.block_size


@dataclass
class AttentionGroup:
    """Sequences attended together: rows gathered to ``[num_seqs, max_q]``, keys to ``max_k``."""

    row_index: torch.Tensor  # [num_seqs, max_q] rows of the packed step (repeats pad short seqs)
    kv_index: torch.Tensor  # [num_seqs, max_k] flat cache index of each key position
    mask: torch.Tensor  # [num_seqs, 1, max_q, max_k] True where the row may attend the key


@dataclass
class PagedStep:
    """Per-step attention metadata, passed to every layer as the ``paged`` keyword argument."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [num_tokens] flat cache index each row writes
    decode: AttentionGroup | None  # seqs with one row, rows [0, num_decode)
    prefill: AttentionGroup | None  # the other seqs
    prefill_scatter: tuple[torch.Tensor, torch.Tensor] | None  # (seq, offset) of prefill rows
    num_decode_rows: int

    @classmethod
    def build(
        cls,
        kv_cache: KVCache,
        *,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
        query_start: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        num_single_token_seqs: int,
        max_query_len: int,
        max_context_len: int,
    ) -> PagedStep:
        """Build gather indices on the device; only host integers decide shapes (no sync)."""
        num_seqs = context_lens.shape[0]
        n_dec = num_single_token_seqs
        key_pos = torch.arange(max_context_len, device=positions.device)  # [max_k]
        bs = kv_cache.block_size
        # Key position l of seq s lives at block_tables[s, l // bs] * bs + l % bs.
        kv_index = block_tables[:, key_pos // bs].long() * bs + key_pos % bs  # [S, max_k]
        key_valid = key_pos[None, :] < context_lens[:, None].long()  # [S, max_k]

        decode = None
        if n_dec:
            rows = torch.arange(n_dec, device=positions.device)[:, None]
            decode = AttentionGroup(rows, kv_index[:n_dec], key_valid[:n_dec, None, None, :])
        prefill = scatter = None
        if n_dec < num_seqs:
            starts = query_start[n_dec:num_seqs].long()  # [P]
            lengths = query_start[n_dec + 1 : num_seqs + 1].long() - starts
            offsets = torch.arange(max_query_len, device=positions.device)  # [max_q]
            # Rows past a seq's chunk repeat its last row: valid input, output discarded.
            rows = starts[:, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)
            row_pos = positions[rows]  # [P, max_q]
            mask = key_pos[None, None, :] <= row_pos[:, :, None]  # causal within the cache
            prefill = AttentionGroup(rows, kv_index[n_dec:], mask[:, None])
            num_rows = int(positions.shape[0])
            row_ids = torch.arange(n_dec, num_rows, device=positions.device)
            seq_of_row = torch.searchsorted(starts, row_ids, right=True) - 1
            scatter = (seq_of_row, row_ids - starts[seq_of_row])
        return cls(kv_cache, slot_mapping, decode, prefill, scatter, n_dec)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, num_tokens, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    paged: PagedStep,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    layer = module.layer_idx
    k_cache = paged.kv_cache.keys[layer]
    v_cache = paged.kv_cache.values[layer]
    k_cache.index_copy_(0, paged.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, paged.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))

    q = query[0].transpose(0, 1)  # [num_tokens, heads, head_dim]
    out = torch.empty_like(q)
    if paged.decode is not None:
        n = paged.num_decode_rows
        out[:n] = _attend(q, k_cache, v_cache, paged.decode, scaling)[:, 0]
    if paged.prefill is not None and paged.prefill_scatter is not None:
        padded = _attend(q, k_cache, v_cache, paged.prefill, scaling)  # [P, max_q, H, D]
        seq, offset = paged.prefill_scatter
        out[paged.num_decode_rows :] = padded[seq, offset]
    return out[None], None  # [1, num_tokens, heads, head_dim]


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scaling: float | None,
) -> torch.Tensor:
    """Attention for one group; returns ``[num_seqs, max_q, heads, head_dim]``.

    Grouped-query attention is folded into the query length: the ``G`` query heads that share
    a KV head become ``G`` times as many query rows of that head, so no backend has to
    support GQA and no KV is repeated. cuDNN's attention is left out: it plans a graph per
    new shape, and the key length changes at every decode step.
    """
    num_seqs, max_q = group.row_index.shape
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    group_size = q.shape[1] // kv_heads
    q_g = q[group.row_index]  # [S, max_q, H, D]
    q_g = q_g.view(num_seqs, max_q, kv_heads, group_size, head_dim).permute(0, 2, 3, 1, 4)
    q_g = q_g.reshape(num_seqs, kv_heads, group_size * max_q, head_dim)  # rows: (g, j)
    k_g = k_cache[group.kv_index].transpose(1, 2).to(q.dtype)  # [S, KVH, max_k, D]
    v_g = v_cache[group.kv_index].transpose(1, 2).to(q.dtype)
    mask = group.mask.expand(-1, -1, max_q, -1)  # [S, 1, max_q, max_k]
    mask = mask.repeat(1, 1, group_size, 1)  # [S, 1, G * max_q, max_k], rows (g, j)
    with sdpa_kernel(_BACKENDS):
        out = F.scaled_dot_product_attention(q_g, k_g, v_g, attn_mask=mask, scale=scaling)
    out = out.view(num_seqs, kv_heads, group_size, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs, max_q, kv_heads * group_size, head_dim)


def register() -> str:
    """Make ``attn_implementation="cbpipe_paged"`` available to transformers models."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
