"""The Triton path: the paged kernels of ``cbpipe/worker/kernels`` read the pages in place.

Each layer's variant (scaling, sliding window, soft-cap, sinks) goes to the kernels as launch
arguments: the window and whether there is a soft-cap or sinks select compiled variants
(``tl.constexpr``), so a model with alternating sliding and global layers compiles two
variants of each kernel, both met by the runner's warm-up before serving; nothing in a launch
depends on a device value, so CUDA graphs capture them and replay them per layer.

Decode rows in CUDA graphs go through one custom op a layer, ``cbpipe::decode_attention``,
which stores the rows' keys and values and attends them: an opaque call that graphs capture.
Eager steps store the rows with the cache-write kernel before their groups attend.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from cbpipe.worker.attention.variant import AttentionVariant

log = logging.getLogger(__name__)


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
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        num_splits: int | None = None,
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
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass
class DecodeKernelRows:
    """Rows ``[0, num_rows)``, one query token per sequence, through the split-KV kernel."""

    kernel: DecodeKernel
    context_lens: torch.Tensor  # [num_rows] int32
    block_tables: torch.Tensor  # flat int32; row s's block ids at [s * width, (s + 1) * width)
    block_table_width: torch.Tensor  # [1] int64 on the device: the slot header's copy
    block_size: int
    num_splits: int | None = None  # None: the kernel's default for the rows

    def attend(
        self,
        variant: AttentionVariant,
        query: torch.Tensor,  # [num_tokens, heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,  # the decode rows are written
    ) -> None:
        n = self.context_lens.shape[0]
        self.kernel(
            query[:n],
            k_cache,
            v_cache,
            self.block_tables,
            self.block_table_width,
            self.context_lens,
            block_size=self.block_size,
            scale=variant.scaling,
            sliding_window=variant.sliding_window,
            softcap=variant.softcap,
            sinks=variant.sinks,
            num_splits=self.num_splits,
            out=out[:n],
        )


@dataclass
class PrefillKernelRows:
    """Sequences with several rows (prefill chunks), after the decode rows, through the
    varlen kernel."""

    kernel: PrefillKernel
    query_start: torch.Tensor  # [P + 1] int32; starts at the number of decode rows
    context_lens: torch.Tensor  # [P] int32
    block_tables: torch.Tensor  # [P, width] int32
    max_query_len: int
    block_size: int

    def attend(
        self,
        variant: AttentionVariant,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,  # the kernel writes the prefill rows only
    ) -> None:
        self.kernel(
            query,
            k_cache,
            v_cache,
            self.block_tables,
            self.query_start,
            self.context_lens,
            block_size=self.block_size,
            scale=variant.scaling,
            max_query_len=self.max_query_len,
            sliding_window=variant.sliding_window,
            softcap=variant.softcap,
            sinks=variant.sinks,
            out=out,
        )


@torch.library.custom_op("cbpipe::decode_attention", mutates_args=("key_cache", "value_cache"))
def decode_attention(
    query: torch.Tensor,  # [num_rows, heads, head_dim]
    key: torch.Tensor,  # [num_rows, kv_heads, head_dim]: each row's own, not yet cached
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_rows]: where each row's key and value belong
    block_tables: torch.Tensor,
    block_table_width: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Store each decode row's key and value at its slot, and attend the row, in one Triton
    launch (rows with context length 0 store nothing).

    One opaque op for ``torch.compile``: inductor does not trace into the Triton launch, and
    keeps the caches, which it mutates, in place. The variant's arguments are constants of
    each layer's call, so one compiled graph serves every step."""
    from cbpipe.worker.kernels.paged_decode import NewRows, paged_decode_attention

    return paged_decode_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        block_table_width,
        context_lens,
        block_size=block_size,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
        new_rows=NewRows(key, value, slot_mapping),
    )


@decode_attention.register_fake
def _decode_attention_shape(query: torch.Tensor, *args: object) -> torch.Tensor:
    # Contiguous, as the kernel allocates it, whatever the query's strides (``empty_like``
    # would copy a transposed query's strides, and inductor then checks the real output
    # against them).
    return query.new_empty(query.shape)


def _load_kernel(flag: str, backend: str, device: torch.device, module: str, name: str):  # type: ignore[no-untyped-def]
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
