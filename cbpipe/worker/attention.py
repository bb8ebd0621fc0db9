"""Paged attention, plugged into unmodified transformers models through ``AttentionInterface``.

The model runs one packed sequence of all the step's rows (batch dimension 1). Each layer's
attention call writes the rows' keys and values into the paged cache, then attends each row to
its own sequence's cached keys, gathered through the block table. Rows of one query token
(decodes) are attended as one batch; sequences with several rows (prefill chunks) as another,
padded to the longest chunk, so a long chunk never pads the decode batch.

Decode rows go to a Triton split-KV kernel on CUDA (``kernels/paged_decode.py``), which reads
the block tables itself and takes no host arguments that change from step to step, so decode
steps can be captured in CUDA graphs. Everything else, and everything on the CPU, takes the
plain torch path: gather the pages, then SDPA. Its gather indices and masks are built once per
step in ``PagedStep.build`` and shared by every layer.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "cbpipe_paged"
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class DecodeKernel(Protocol):
    """The signature of ``kernels.paged_decode.paged_decode_attention``."""

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        block_table_width: torch.Tensor,
        context_lens: torch.Tensor,
        *,
        block_size: int,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class PrefillKernel(Protocol):
    """The signature of ``kernels.paged_prefill.paged_prefill_attention``."""

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start: torch.Tensor,
        context_lens: torch.Tensor,
        *,
        block_size: int,
        scale: float,
        max_query_len: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass
class PrefillRows:
    """Sequences with several rows (prefill chunks), after the decode rows, for the kernel."""

    query_start: torch.Tensor  # [P + 1] int32; starts at the number of decode rows
    context_lens: torch.Tensor  # [P] int32
    block_tables: torch.Tensor  # [P, width] int32
    max_query_len: int
    kernel: PrefillKernel


@dataclass
class KVCache:
    """Per-layer key and value tensors, ``[(num_blocks + 1) * block_size, kv_heads, head_dim]``.

    The block after the last usable one belongs to no sequence: rows that only pad a batch
    up to a captured graph's size write their keys and values there.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int
    num_blocks: int  # usable blocks, handed to the scheduler

    @property
    def padding_slot(self) -> int:
        return self.num_blocks * self.block_size


@dataclass
class AttentionGroup:
    """Sequences attended together by the torch path, rows gathered to ``[num_seqs, max_q]``."""

    row_index: torch.Tensor  # [num_seqs, max_q] rows of the packed step (repeats pad short seqs)
    kv_index: torch.Tensor  # [num_seqs, max_k] flat cache index of each key position
    # [num_seqs, 1, group_size * max_q, max_k], True where the row may attend the key; query
    # rows are ordered (query head within its KV group, row), see ``attend_gathered``.
    mask: torch.Tensor


@dataclass
class DecodeRows:
    """Sequences of one query row each: rows ``[0, num_rows)`` of the step."""

    context_lens: torch.Tensor  # [num_rows] int32; 0 on padding rows, which attend nothing
    block_tables: torch.Tensor  # flat int32; row s's block ids at [s * width, (s + 1) * width)
    block_table_width: torch.Tensor  # [1] int64 on the device: the slot header's copy
    kernel: DecodeKernel | None  # None: the torch path, through ``gathered``
    gathered: AttentionGroup | None


@dataclass
class PagedStep:
    """Per-step attention metadata, passed to every layer as the ``paged`` keyword argument."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [num_tokens] flat cache index each row writes
    decode: DecodeRows | None
    prefill: AttentionGroup | None  # seqs with several rows, after the decode rows
    prefill_scatter: tuple[torch.Tensor, torch.Tensor] | None  # (seq, offset) of prefill rows
    num_decode_rows: int
    prefill_rows: PrefillRows | None = None  # set: prefill rows take the Triton kernel
    # Decode rows only, through the ``cbpipe::decode_attention`` op: one opaque call per layer
    # that torch.compile leaves alone and CUDA graphs capture.
    decode_op: bool = False
    # New keys and values go to the cache through ``cbpipe::write_kv_cache`` (a Triton
    # kernel), not index assignment; set where the attention kernels run.
    write_op: bool = False

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
        block_table_width: torch.Tensor,
        num_single_token_seqs: int,
        max_query_len: int,
        max_context_len: int,
        kv_group_size: int,
        decode_kernel: DecodeKernel | None,
        prefill_kernel: PrefillKernel | None = None,
    ) -> PagedStep:
        """Build gather indices on the device; only host integers decide shapes (no sync).

        ``block_tables`` is ``[num_seqs, width]``; ``block_table_width`` its width on the device.
        """
        num_seqs = block_tables.shape[0]
        n_dec = num_single_token_seqs
        device = positions.device
        has_prefill = n_dec < num_seqs
        # Only the torch path gathers; the kernels read the block tables themselves.
        if (has_prefill and prefill_kernel is None) or (n_dec and decode_kernel is None):
            key_pos = torch.arange(max_context_len, device=device)  # [max_k]
            bs = kv_cache.block_size
            # Key position l of seq s lives at block_tables[s, l // bs] * bs + l % bs.
            kv_index = block_tables[:, key_pos // bs].long() * bs + key_pos % bs  # [S, max_k]

        decode = None
        if n_dec:
            gathered = None
            if decode_kernel is None:
                rows = torch.arange(n_dec, device=device)[:, None]
                valid = key_pos[None, :] < context_lens[:n_dec, None].long()  # [n_dec, max_k]
                mask = valid[:, None, None, :].expand(-1, -1, kv_group_size, -1).contiguous()
                gathered = AttentionGroup(rows, kv_index[:n_dec], mask)
            decode = DecodeRows(
                context_lens[:n_dec],
                block_tables[:n_dec].reshape(-1),
                block_table_width,
                decode_kernel,
                gathered,
            )
        prefill = scatter = prefill_rows = None
        if has_prefill and prefill_kernel is not None:
            prefill_rows = PrefillRows(
                query_start[n_dec : num_seqs + 1],
                context_lens[n_dec:],
                block_tables[n_dec:],
                max_query_len,
                prefill_kernel,
            )
        elif has_prefill:
            starts = query_start[n_dec:num_seqs].long()  # [P]
            lengths = query_start[n_dec + 1 : num_seqs + 1].long() - starts
            offsets = torch.arange(max_query_len, device=device)  # [max_q]
            # Rows past a seq's chunk repeat its last row: valid input, output discarded.
            rows = starts[:, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)
            row_pos = positions[rows]  # [P, max_q]
            mask = key_pos[None, None, :] <= row_pos[:, :, None]  # causal within the cache
            mask = mask[:, None].repeat(1, 1, kv_group_size, 1)  # [P, 1, G * max_q, max_k]
            prefill = AttentionGroup(rows, kv_index[n_dec:], mask)
            num_rows = int(positions.shape[0])
            row_ids = torch.arange(n_dec, num_rows, device=device)
            seq_of_row = torch.searchsorted(starts, row_ids, right=True) - 1
            scatter = (seq_of_row, row_ids - starts[seq_of_row])
        write_op = decode_kernel is not None or prefill_kernel is not None
        return cls(
            kv_cache, slot_mapping, decode, prefill, scatter, n_dec, prefill_rows, write_op=write_op
        )

    @classmethod
    def decode_only(
        cls,
        kv_cache: KVCache,
        *,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        block_table_width: torch.Tensor,
    ) -> PagedStep:
        """A step of single-row sequences with fixed shapes, as a CUDA graph captures it.

        ``block_tables`` is flat and its row width lives on the device only, so one graph
        serves every width. Attention goes through the Triton kernel (``decode_attention``).
        """
        decode = DecodeRows(context_lens, block_tables, block_table_width, None, None)
        return cls(
            kv_cache,
            slot_mapping,
            decode,
            None,
            None,
            len(slot_mapping),
            decode_op=True,
            write_op=True,
        )


@torch.library.custom_op("cbpipe::decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor,  # [num_rows, heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    block_table_width: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Attend one decode row per sequence with the Triton kernel (the rows' keys and values
    are already in the cache).

    One opaque op for ``torch.compile``: inductor does not trace into the Triton launch."""
    from cbpipe.worker.kernels.paged_decode import paged_decode_attention

    return paged_decode_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        block_table_width,
        context_lens,
        block_size=block_size,
        scale=scale,
    )


@decode_attention.register_fake
def _decode_attention_shape(query: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(query)


@torch.library.custom_op("cbpipe::write_kv_cache", mutates_args=("key_cache", "value_cache"))
def write_kv_cache(
    key: torch.Tensor,  # [num_rows, kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_rows]
) -> None:
    """Store each row's key and value at its slot: one Triton launch on CUDA.

    An op that mutates the caches, which inductor keeps in place (no copy of the cache: the
    caches are inputs of the compiled graph), and which leaves the keys' rotary embedding to
    inductor as a kernel that mutates nothing (``kernels/cache_write.py`` says why that
    matters). Elsewhere it is index assignment."""
    if key.is_cuda:
        from cbpipe.worker.kernels.cache_write import write_kv_cache as kernel

        kernel(key, value, key_cache, value_cache, slot_mapping)
    else:
        key_cache[slot_mapping] = key
        value_cache[slot_mapping] = value


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
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    new_keys = key[0].transpose(0, 1).to(k_cache.dtype)  # [num_tokens, kv_heads, head_dim]
    new_values = value[0].transpose(0, 1).to(v_cache.dtype)
    if paged.write_op:
        torch.ops.cbpipe.write_kv_cache(new_keys, new_values, k_cache, v_cache, paged.slot_mapping)
    else:
        k_cache[paged.slot_mapping] = new_keys
        v_cache[paged.slot_mapping] = new_values
    if paged.decode_op:
        decode = paged.decode
        assert decode is not None
        out = torch.ops.cbpipe.decode_attention(
            query[0].transpose(0, 1),
            k_cache,
            v_cache,
            decode.block_tables,
            decode.block_table_width,
            decode.context_lens,
            paged.kv_cache.block_size,
            scaling,
        )
        return out[None], None

    q = query[0].transpose(0, 1)  # [num_tokens, heads, head_dim]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if paged.decode is not None:
        n = paged.num_decode_rows
        _attend_decode(q[:n], k_cache, v_cache, paged, scaling, out[:n])
    if paged.prefill_rows is not None:
        rows = paged.prefill_rows
        rows.kernel(
            q,
            k_cache,
            v_cache,
            rows.block_tables,
            rows.query_start,
            rows.context_lens,
            block_size=paged.kv_cache.block_size,
            scale=scaling,
            max_query_len=rows.max_query_len,
            out=out,  # the kernel writes the prefill rows only
        )
    elif paged.prefill is not None and paged.prefill_scatter is not None:
        padded = attend_gathered(q, k_cache, v_cache, paged.prefill, scaling)  # [P, max_q, H, D]
        seq, offset = paged.prefill_scatter
        out[paged.num_decode_rows :] = padded[seq, offset]
    return out[None], None  # [1, num_tokens, heads, head_dim]


def _attend_decode(
    q: torch.Tensor,  # [num_rows, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    paged: PagedStep,
    scaling: float,
    out: torch.Tensor,  # [num_rows, heads, head_dim], written
) -> None:
    decode = paged.decode
    assert decode is not None
    if decode.kernel is not None:
        decode.kernel(
            q,
            k_cache,
            v_cache,
            decode.block_tables,
            decode.block_table_width,
            decode.context_lens,
            block_size=paged.kv_cache.block_size,
            scale=scaling,
            out=out,
        )
    else:
        assert decode.gathered is not None
        out.copy_(attend_gathered(q, k_cache, v_cache, decode.gathered, scaling)[:, 0])


def attend_gathered(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scaling: float,
) -> torch.Tensor:
    """The torch path: attention for one group; returns ``[num_seqs, max_q, heads, head_dim]``.

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
    with sdpa_kernel(_BACKENDS):
        out = F.scaled_dot_product_attention(q_g, k_g, v_g, attn_mask=group.mask, scale=scaling)
    out = out.view(num_seqs, kv_heads, group_size, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs, max_q, kv_heads * group_size, head_dim)


def _load_kernel(flag: str, backend: str, device: torch.device, module: str, name: str):
    """A Triton kernel if ``backend`` and ``device`` call for it, else None (the torch path).

    ``auto`` takes the kernel on CUDA when triton imports; ``triton`` insists on it.
    """
    if backend == "torch" or device.type != "cuda":
        if backend == "triton":
            raise ValueError(f"{flag} triton needs a CUDA device, not {device}")
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        if backend == "triton":
            raise RuntimeError(f"{flag} triton, but triton fails to import: {exc}") from exc
        log.warning("triton is not importable (%s); %s falls back to torch", exc, flag)
        return None


def load_decode_kernel(backend: str, device: torch.device) -> DecodeKernel | None:
    return _load_kernel(
        "--attention-backend",
        backend,
        device,
        "cbpipe.worker.kernels.paged_decode",
        "paged_decode_attention",
    )


def load_prefill_kernel(backend: str, device: torch.device) -> PrefillKernel | None:
    return _load_kernel(
        "--prefill-attention-backend",
        backend,
        device,
        "cbpipe.worker.kernels.paged_prefill",
        "paged_prefill_attention",
    )


def register() -> str:
    """Make ``attn_implementation="cbpipe_paged"`` available to transformers models."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
