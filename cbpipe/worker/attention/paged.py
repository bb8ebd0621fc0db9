"""A step's attention over the paged KV cache: the two kinds of step the runner runs.

The model runs one packed sequence of all the step's rows (batch dimension 1). Each layer's
attention call writes the rows' keys and values into the paged cache, then attends each row
to its own sequence's cached keys through the block table.

- ``PagedStep``: any step, run eagerly. Its rows fall into two groups, each attended by one
  ``RowsAttention``: rows of one query token (decodes) first, then sequences of several rows
  (prefill chunks), so a long chunk never pads the decode batch. Each group takes the Triton
  kernel or the torch path (``triton_rows.py``, ``torch_rows.py``), chosen when the step is
  built; nothing else in the step depends on the choice.
  ``PagedStep.for_graph`` builds one whose launches depend only on a mixed graph's sizes,
  its make-up read from device tensors, as CUDA graphs of mixed steps capture it.
- ``DecodeGraphStep``: a decode-only step of fixed shapes, as CUDA graphs capture it: one
  custom op per layer, which stores the rows' keys and values and attends.
- ``OpaqueStep``: either of them under ``torch.compile``. Dynamo sees one custom op per
  layer, ``cbpipe::step_attention``, and none of the step's metadata, so the one compiled
  graph of a decoder layer serves the decode graphs and the eager steps of any make-up.

A new backend is one more ``RowsAttention``; a new attention variant is a field of
``AttentionVariant`` that the groups pass on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cbpipe.worker.attention.binding import bound_step
from cbpipe.worker.attention.torch_rows import GatheredRows, gather_index
from cbpipe.worker.attention.triton_rows import (
    DecodeKernel,
    DecodeKernelRows,
    PrefillKernel,
    PrefillKernelRows,
)
from cbpipe.worker.attention.variant import AttentionVariant


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


class RowsAttention(Protocol):
    """One group of a step's rows, prepared for one way of attending (a backend)."""

    def attend(
        self,
        variant: AttentionVariant,
        query: torch.Tensor,  # [num_tokens, heads, head_dim], the whole step
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,  # [num_tokens, heads, head_dim]: the group writes its own rows
    ) -> None: ...


CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def write_by_index(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:  # fmt: skip
    k_cache[slot_mapping] = key
    v_cache[slot_mapping] = value


def write_with_kernel(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:  # fmt: skip
    """One Triton launch a layer on CUDA (``kernels/cache_write.py``), index assignment
    elsewhere. A plain call, not an op: eager steps reach it directly or from inside
    ``cbpipe::step_attention``, and an op's dispatch of its own cost tens of microseconds of
    host time a layer in steps whose host time bounds them."""
    if not key.is_cuda:
        write_by_index(key, value, k_cache, v_cache, slot_mapping)
        return
    from cbpipe.worker.kernels.cache_write import write_kv_cache

    write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


# Each attention module holds its layer's part of the cache as two buffers (not saved with
# the model), so a layer's forward reaches its cache the way it reaches its weights. A compiled
# decoder layer is then one graph for every layer (``worker/compiled_layers.py``); an index
# into a list of layers, read in the attention call, made dynamo compile each layer apart.
_KEYS, _VALUES = "cbpipe_key_cache", "cbpipe_value_cache"


def attach_kv_cache(kv_cache: KVCache, modules: Sequence[torch.nn.Module]) -> None:
    """Give each layer's attention module (in layer order) its keys and values."""
    for module, keys, values in zip(modules, kv_cache.keys, kv_cache.values, strict=True):
        module.register_buffer(_KEYS, keys, persistent=False)
        module.register_buffer(_VALUES, values, persistent=False)


def layer_cache(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ``attach_kv_cache`` gave the attention module ``layer``."""
    return getattr(layer, _KEYS), getattr(layer, _VALUES)


def _to_cache(
    layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    k_cache, v_cache = layer_cache(layer)
    return k_cache, v_cache, key.to(k_cache.dtype), value.to(v_cache.dtype)


class CacheAttention(Protocol):
    """A step's attention for one layer, given that layer's part of the cache; a step that
    derives from it has ``attend`` (``StepAttention``) find that part on the layer."""

    def attend(
        self,
        layer: torch.nn.Module,
        variant: AttentionVariant,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        return self.attend_cache(variant, query, *_to_cache(layer, key, value))

    def attend_cache(
        self,
        variant: AttentionVariant,
        query: torch.Tensor,  # [num_tokens, heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,  # [num_tokens, kv_heads, head_dim], in the cache's dtype
        value: torch.Tensor,
    ) -> torch.Tensor: ...


@dataclass
class PagedStep(CacheAttention):
    """Any step's attention, eagerly: the cache write, then each group of rows."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [num_tokens] flat cache index each row writes
    write: CacheWrite
    groups: tuple[RowsAttention, ...]  # decode rows first, then prefill chunks

    def attend_cache(
        self,
        variant: AttentionVariant,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        self.write(key, value, k_cache, v_cache, self.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        for group in self.groups:
            group.attend(variant, query, k_cache, v_cache, out)
        return out

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
        windows: Iterable[int | None] = (None,),
        decode_kernel: DecodeKernel | None = None,
        prefill_kernel: PrefillKernel | None = None,
    ) -> PagedStep:
        """Build each group's metadata on the device; only host integers decide shapes (no
        sync). ``block_tables`` is ``[num_seqs, width]``; ``block_table_width`` its width on
        the device; ``windows`` the sliding windows of the model's layers (None: none), for
        the torch path's masks. A kernel given takes its group; None: the torch path."""
        num_seqs = block_tables.shape[0]
        n_dec = num_single_token_seqs
        has_prefill = n_dec < num_seqs
        bs = kv_cache.block_size
        # Only the torch path gathers; the kernels read the block tables themselves.
        if (has_prefill and prefill_kernel is None) or (n_dec and decode_kernel is None):
            key_pos, kv_index = gather_index(block_tables, max_context_len, bs)
        groups: list[RowsAttention] = []
        if n_dec and decode_kernel is not None:
            groups.append(
                DecodeKernelRows(
                    decode_kernel,
                    context_lens[:n_dec],
                    block_tables[:n_dec].reshape(-1),
                    block_table_width,
                    bs,
                )
            )
        elif n_dec:
            lens = context_lens[:n_dec]
            groups.append(GatheredRows.decode(kv_index[:n_dec], key_pos, lens, kv_group_size,
                                              windows))  # fmt: skip
        if has_prefill and prefill_kernel is not None:
            groups.append(
                PrefillKernelRows(
                    prefill_kernel,
                    query_start[n_dec : num_seqs + 1],
                    context_lens[n_dec:],
                    block_tables[n_dec:],
                    max_query_len,
                    bs,
                )
            )
        elif has_prefill:
            groups.append(
                GatheredRows.prefill(
                    kv_index[n_dec:],
                    key_pos,
                    positions,
                    query_start[n_dec : num_seqs + 1],
                    n_dec,
                    max_query_len,
                    kv_group_size,
                    windows,
                )
            )
        kernels = decode_kernel is not None or prefill_kernel is not None
        return cls(kv_cache, slot_mapping, write_with_kernel if kernels else write_by_index,
                   tuple(groups))  # fmt: skip

    @classmethod
    def for_graph(
        cls,
        kv_cache: KVCache,
        *,
        rows: int,
        seqs: int,
        max_chunks: int,
        max_blocks_per_seq: int,
        num_tokens: torch.Tensor,
        num_seqs: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        block_table_width: torch.Tensor,
        indices: torch.Tensor,
        decode_kernel: DecodeKernel,
        prefill_kernel: PrefillKernel,
        decode_rows: int,
        decode_splits: int,
    ) -> PagedStep:
        """A mixed step padded to ``rows`` token rows and ``seqs`` sequences, of which at
        most ``max_chunks`` prefill chunks: every launch is fixed by those sizes, and the
        make-up is read on the device, so a CUDA graph captures it once for every step that
        fits.

        ``num_tokens`` and ``num_seqs`` are the slot header's device scalars;
        ``slot_mapping`` ``[rows]``, ``query_start`` ``[seqs + 1]`` and ``context_lens``
        ``[seqs]`` the slot's fields, real up to those counts; ``block_tables`` flat, rows
        ``block_table_width`` wide (a device scalar); ``indices`` an ``arange`` at least
        ``max(rows, max_blocks_per_seq, max_chunks + 1)`` long; ``decode_rows`` (at most
        ``seqs``) the first sequences, among which every decode of a step the graph runs,
        and ``decode_splits`` the key ranges of each.

        As in ``build``, the decode rows (sequences of one row, which the packer puts first)
        go to the decode kernel and the rest to the prefill kernel: here the decode kernel
        runs over the first ``decode_rows`` sequences with the others' context lengths 0
        (nothing stored or attended, their rows written with zeros before the prefill kernel
        writes them), and the prefill kernel over ``max_chunks`` sequences from the first
        chunk on, those past the step empty. Padding rows store at the padding slot and
        attend nothing; past the decode kernel's rows their output is left unwritten (no
        real row reads it: every product and norm is row by row).
        """
        seq_ids = indices[:seqs]
        real = seq_ids < num_seqs
        single = real & (query_start[1:] - query_start[:-1] == 1)
        decode_lens = torch.where(single, context_lens, 0)[:decode_rows]
        # The chunks' sequences: those after the decodes, clamped to num_seqs, where
        # query_start holds num_tokens, so a chunk past the step is empty.
        chunk_seqs = torch.minimum(single.sum() + indices[: max_chunks + 1], num_seqs)
        chunk_starts = query_start[chunk_seqs]
        chunk_ids = chunk_seqs[:-1]
        chunk_lens = torch.where(
            chunk_ids < num_seqs, context_lens[chunk_ids.clamp(max=seqs - 1)], 0
        )
        # Each chunk's block-table row, copied to a fixed width (the step's width lives on
        # the device only); entries past the step's width are never read.
        table_index = chunk_ids[:, None] * block_table_width + indices[None, :max_blocks_per_seq]
        chunk_tables = block_tables[table_index.clamp(max=block_tables.numel() - 1)]
        padded = torch.where(indices[:rows] < num_tokens, slot_mapping, kv_cache.padding_slot)
        bs = kv_cache.block_size
        groups = (
            DecodeKernelRows(
                decode_kernel, decode_lens, block_tables, block_table_width, bs, decode_splits
            ),
            PrefillKernelRows(
                prefill_kernel,
                chunk_starts.to(torch.int32),
                chunk_lens.to(torch.int32),
                chunk_tables,
                rows,
                bs,
            ),
        )
        return cls(kv_cache, padded, write_with_kernel, groups)


@dataclass
class DecodeGraphStep(CacheAttention):
    """A step of single-row sequences with fixed shapes, as a CUDA graph captures it.

    ``block_tables`` is flat and its row width lives on the device only, so one graph serves
    every width. Per layer one launch, ``cbpipe::decode_attention``, stores the rows' keys
    and values and attends them.
    """

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [batch]; read for the rows with a context only
    context_lens: torch.Tensor  # [batch] int32; 0 on padding rows, which store and attend nothing
    block_tables: torch.Tensor  # flat int32
    block_table_width: torch.Tensor  # [1] int64 on the device: the slot header's copy

    def attend_cache(
        self,
        variant: AttentionVariant,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        return torch.ops.cbpipe.decode_attention(
            query,
            key,
            value,
            k_cache,
            v_cache,
            self.slot_mapping,
            self.block_tables,
            self.block_table_width,
            self.context_lens,
            self.kv_cache.block_size,
            variant.scaling,
            variant.sliding_window,
            variant.softcap,
            variant.sinks,
        )


@dataclass
class OpaqueStep(CacheAttention):
    """``step`` as a compiled forward sees it: each layer's attention is one call of
    ``cbpipe::step_attention``, whose arguments are the layer's tensors and constants and the
    binding's number.

    Dynamo traces this ``attend_cache`` and not ``step``'s, so nothing of the step (its
    groups, lengths, kernels, metadata tensors) becomes a guard or a graph input: a decode
    graph body and an eager step of prefill chunks run the same compiled graph of each
    decoder layer. The op runs ``step`` eagerly: in a CUDA graph's capture its launches are
    recorded, in an eager step they run.
    """

    step: CacheAttention
    binding: int  # the number of the binding this step is bound to (``bound_step``)

    def attend_cache(
        self,
        variant: AttentionVariant,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        return torch.ops.cbpipe.step_attention(
            query,
            key,
            value,
            k_cache,
            v_cache,
            self.binding,
            variant.scaling,
            variant.sliding_window,
            variant.softcap,
            variant.sinks,
        )


# Defined through ``torch.library.Library``, not ``torch.library.custom_op``: the latter wraps
# its function in autograd and view-tracking layers whose host time is several times the
# dispatch's own, and eager steps make a call a layer with their host time as their bound
# (docs/PERFORMANCE.md). The schema marks the caches as written (``a!``, ``b!``), which is
# what lets inductor keep them in place.
_LIBRARY = torch.library.Library("cbpipe", "FRAGMENT")
_LIBRARY.define(
    "step_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache, "
    "Tensor(b!) value_cache, int binding, float scale, int? sliding_window, float? softcap, "
    "Tensor? sinks) -> Tensor"
)


def step_attention(
    query: torch.Tensor,  # [num_tokens, heads, head_dim]
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    binding: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``cbpipe::step_attention``: the attention of the ``OpaqueStep`` bound to binding number
    ``binding``, for one layer: store the rows' keys and values, attend."""
    step = bound_step(binding)
    if not isinstance(step, OpaqueStep):
        raise RuntimeError(f"cbpipe::step_attention ran with a {type(step).__name__} bound")
    variant = AttentionVariant(scale, sliding_window, softcap, sinks)
    return step.step.attend_cache(variant, query, key_cache, value_cache, key, value)


_LIBRARY.impl("step_attention", step_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("cbpipe::step_attention")
def _step_attention_shape(query: torch.Tensor, *args: object) -> torch.Tensor:
    return query.new_empty(query.shape)  # contiguous, as both kinds of step allocate it
