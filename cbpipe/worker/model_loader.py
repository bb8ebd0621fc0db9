"""Loading unmodified transformers causal LMs, and allocating their paged KV cache.

The engine's model (``start_paged_model``) takes a checkpoint's weights in the background
where it can: built on the device with random weights, probed, then filled from the
safetensors files by a thread of its own (``PendingWeights``) while the worker warms up,
compiles and captures its graphs, which need the weights' storage and never their values. On
an H100 an 8B checkpoint's 3.7 s load from the page cache left the warm start-up's path, and
the worker started 2.0 s sooner (docs/PERFORMANCE.md, session 50).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

from cbpipe.config import CacheConfig
from cbpipe.models import ModelSource
from cbpipe.models.support import check_config, own_attention_table_error
from cbpipe.worker.attention import (
    KVCache,
    ModelAttention,
    StepBinding,
    attach_kv_cache,
    probe_model,
    register,
)
from cbpipe.worker.fused_projections import fuse_projections
from cbpipe.worker.tensor_parallel import (
    TensorParallel,
    checkpoint_tensors,
    read_shard,
    retie_output_head,
    shard_model,
)

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, rank: int | None = None) -> torch.device:
    """``rank``: a tensor-parallel worker rank, which takes this host's GPU of its number
    (modulo the GPUs the host has: with ranks on several hosts, each host's first rank
    takes its GPU 0)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    if name == "cuda" and rank is not None:
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_model(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    attn_implementation: str | None = "sdpa",
    fuse: bool = False,
    tp: TensorParallel | None = None,
) -> PreTrainedModel:
    """The model in eval mode on ``device``; presets get seeded random weights made there.

    ``attn_implementation`` None lets transformers choose (SDPA where the model supports it).

    ``fuse`` joins sibling projections into one product each (``fused_projections``), after
    sharding: each rank fuses its own shards.

    ``tp`` of more than one rank: this rank's shard only (``tensor_parallel.py``).
    """
    if tp is not None and tp.world_size > 1:
        model = _load_shard(source, device, dtype, seed, attn_implementation, tp)
    elif source.path is None:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                source.config, dtype=dtype, attn_implementation=attn_implementation
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            source.path, dtype=dtype, attn_implementation=attn_implementation
        ).to(device)
    model.eval().requires_grad_(False)
    if fuse:
        fuse_projections(model)
    return model


def _load_shard(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    attn_implementation: str | None,
    tp: TensorParallel,
) -> PreTrainedModel:
    """This rank's shard on ``device``. The model is built without storage (``meta``) and
    sliced, and only the shard is materialised, on the device: a model that fits the ranks
    together but not one device (the 70B preset on two GPUs) starts. A checkpoint of
    safetensors under the model's own names then fills it with this rank's slices, read
    from the files alone (``read_shard``); any other checkpoint loads whole into host
    memory, is sliced there and only the shard moves. A preset's weights are random:
    seeded, but not the ones the preset has at size 1 (the random stream follows the
    shapes), so comparisons across sizes use checkpoint folders."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            source.config, dtype=dtype, attn_implementation=attn_implementation
        )
    styles = shard_model(model, tp)
    where = None
    if source.path is not None:
        where = checkpoint_tensors(model, Path(source.path))
        if where is None:
            model = AutoModelForCausalLM.from_pretrained(
                source.path, dtype=dtype, attn_implementation=attn_implementation
            )
            shard_model(model, tp)
            return model.to(device)
    model.to_empty(device=device)
    torch.manual_seed(seed)  # the same stream on every rank: replicated weights agree
    # Random weights for a preset; for a checkpoint, the buffers its files do not hold
    # (rotary frequencies) computed as transformers computes them, then the weights read.
    model.initialize_weights()
    if where is not None:
        read_shard(model, where, styles, tp)
    retie_output_head(model)
    return model


@dataclass
class LoadingModel:
    """The engine's model with paged attention plugged in, its attention as the probe found
    it, and the checkpoint's weights still being read into it, if they are."""

    model: PreTrainedModel
    attention: ModelAttention
    pending: PendingWeights | None = None

    def wait_for_weights(self) -> float:
        """Block until every weight is in place; the seconds waited."""
        return 0.0 if self.pending is None else self.pending.wait()


def start_paged_model(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    fuse: bool = False,
    max_model_len: int | None = None,
    tp: TensorParallel | None = None,
) -> LoadingModel:
    """``load_paged_model`` without waiting for a checkpoint's weights where they can be read
    in the background (``LoadingModel.wait_for_weights`` before the first step)."""
    check_config(source.config, max_model_len)
    binding = StepBinding()
    name = register(binding)
    try:
        empty = _empty_for_checkpoint(source, device, dtype, name, tp)
        if empty is None:
            model = load_model(
                source, device, dtype, seed=seed, attn_implementation=name, fuse=fuse, tp=tp
            )
        else:
            model = empty.model
            if fuse:
                fuse_projections(model)
    except KeyError as exc:
        if exc.args and exc.args[0] == name:  # GPT-J in transformers 5.17, Falcon in any
            raise own_attention_table_error(source.config, exc) from exc
        raise
    # The probe compares two forwards of the same weights: before any is read in.
    attention = probe_model(model, binding, max_model_len)
    log.info("%s: %d attention layers, %s", source.name, attention.num_layers,
             attention.describe())  # fmt: skip
    pending = None if empty is None else PendingWeights(model, empty.files, device)
    return LoadingModel(model, attention, pending)


def load_paged_model(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    fuse: bool = False,
    max_model_len: int | None = None,
    tp: TensorParallel | None = None,
) -> tuple[PreTrainedModel, ModelAttention]:
    """The model with paged attention plugged in, and its attention as the probe found it.

    Raises ``UnsupportedModel`` (naming the architecture and the reason) for a model paged
    attention would serve wrongly: from its configuration before any weight is loaded, then
    from a probe forward of the model.
    """
    loading = start_paged_model(
        source, device, dtype, seed=seed, fuse=fuse, max_model_len=max_model_len, tp=tp
    )
    loading.wait_for_weights()
    return loading.model, loading.attention


@dataclass
class _EmptyModel:
    model: PreTrainedModel  # on its device, random weights
    files: dict[str, Path]  # the tensors to read into it, each by its file


def _empty_for_checkpoint(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str,
    tp: TensorParallel | None,
) -> _EmptyModel | None:
    """``source``'s model on ``device`` with random weights where its checkpoint can be read
    into it tensor by tensor; None where ``from_pretrained`` must load it as transformers
    does: a preset (no checkpoint), tensor parallelism (each rank reads its shard), a
    checkpoint not of safetensors under the model's own names and shapes (transformers
    converts some as it loads), or a model that ``from_pretrained`` keeps partly in float32
    at this dtype."""
    if source.path is None or (tp is not None and tp.world_size > 1):
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            source.config, dtype=dtype, attn_implementation=attn_implementation
        )
    if _keeps_float32(model, dtype):
        return None
    where = checkpoint_tensors(model, Path(source.path))
    if where is None:
        return None
    files = {name: where[name] for name in _state_names(model) if name in where}
    if not _shapes_match(model, files):
        return None
    model.to_empty(device=device)
    model.tie_weights()  # materialised anew, a tied head holds a copy of its own until then
    # Buffers the files do not hold (rotary frequencies) computed as transformers computes
    # them, and weights the probe can run on until the checkpoint's arrive.
    model.initialize_weights()
    model.eval().requires_grad_(False)
    return _EmptyModel(model, files)


def _keeps_float32(model: PreTrainedModel, dtype: torch.dtype) -> bool:
    """Whether ``from_pretrained`` would keep some of ``model``'s modules in float32 at
    ``dtype`` (its ``_keep_in_fp32_modules``), which ``from_config`` does not."""
    strict = getattr(model, "_keep_in_fp32_modules_strict", None)
    loose = getattr(model, "_keep_in_fp32_modules", None)
    return bool(strict and dtype in (torch.float16, torch.bfloat16)) or bool(
        loose and dtype == torch.float16
    )


def _state_names(model: torch.nn.Module) -> list[str]:
    """What ``from_pretrained`` fills: every parameter once (a tied head is the embedding's)
    and every persistent buffer."""
    names = [name for name, _ in model.named_parameters()]
    for prefix, module in model.named_modules():
        for leaf, buffer in module.named_buffers(recurse=False):
            if buffer is not None and leaf not in module._non_persistent_buffers_set:
                names.append(f"{prefix}.{leaf}" if prefix else leaf)
    return names


def _open_files(stack: contextlib.ExitStack, files: dict[str, Path]) -> dict[Path, Any]:
    """Each safetensors file that ``files`` names, opened (mapped) until ``stack`` closes."""
    return {
        file: stack.enter_context(safe_open(str(file), "pt", device="cpu"))
        for file in sorted(set(files.values()))
    }


def read_tensors(files: dict[str, Path], copy: Callable[[str, torch.Tensor], None]) -> None:
    """Each tensor ``files`` names, in its order, handed to ``copy`` (its name, and the
    tensor as mapped from its file: its bytes are read from disk by the first copy that
    touches them)."""
    with contextlib.ExitStack() as stack:
        handles = _open_files(stack, files)
        for name, file in files.items():
            copy(name, handles[file].get_tensor(name))


def _shapes_match(model: torch.nn.Module, files: dict[str, Path]) -> bool:
    with contextlib.ExitStack() as stack:
        handles = _open_files(stack, files)
        return all(
            handles[file].get_slice(name).get_shape() == list(_destination(model, name).shape)
            for name, file in files.items()
        )


def _destination(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The tensor a checkpoint's ``name`` is read into: a parameter, a persistent buffer,
    or, once projections are fused, the fused matrix's rows that the projection views."""
    module_name, _, leaf = name.rpartition(".")
    tensor = getattr(model.get_submodule(module_name), leaf)
    assert isinstance(tensor, torch.Tensor), name
    return tensor


class PendingWeights:
    """A checkpoint's tensors being copied into a model already on its device, by a thread of
    its own and, on CUDA, on a stream of its own. Until ``wait`` returns, kernels that read
    the model see some weights random and some read: fine for warming up, compiling and
    capturing graphs, never for serving. On CUDA the graphs are captured in thread-local mode
    (``cuda_graphs._capture``), so that this thread's copies and synchronisations do not end
    another thread's capture. The copies pass through pinned buffers (``StagedCopies``), so
    that reading the files never happens inside a CUDA call."""

    def __init__(self, model: torch.nn.Module, files: dict[str, Path], device: torch.device):
        # Resolved here, before the worker's threads touch the model's modules.
        destinations = {name: _destination(model, name) for name in files}
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.read_s: float | None = None  # how long the reading took, once done
        self.read_bytes = sum(d.numel() * d.element_size() for d in destinations.values())
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._read, args=(files, destinations, stream), name="weights", daemon=True
        )
        self._thread.start()

    def _read(
        self,
        files: dict[str, Path],
        destinations: dict[str, torch.Tensor],
        stream: torch.cuda.Stream | None,
    ) -> None:
        started = time.perf_counter()
        try:
            with contextlib.ExitStack() as stack, torch.no_grad():
                if stream is not None:
                    stack.enter_context(torch.cuda.stream(stream))
                copies = StagedCopies(pinned=stream is not None)
                read_tensors(files, lambda name, source: copies.copy(destinations[name], source))
                if stream is not None:
                    stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - raised again by wait()
            self._error = exc
        self.read_s = time.perf_counter() - started

    def wait(self) -> float:
        """Block until every weight is in place, raising what reading them raised; the
        seconds waited."""
        started = time.perf_counter()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(
                f"reading the checkpoint's weights failed: {self._error!r}"
            ) from self._error
        waited = time.perf_counter() - started
        assert self.read_s is not None
        log.info("weights read from the checkpoint in %.1f s (%.2f GB, %.2f GB/s) beside the "
                 "start-up, %.1f s waited for", self.read_s, self.read_bytes / 1e9,
                 self.read_bytes / 1e9 / max(self.read_s, 1e-9), waited)  # fmt: skip
        return waited


STAGING_BYTES = 64 << 20


class StagedCopies:
    """Copies of host tensors into device tensors through a few pinned buffers taken in turn.

    A tensor of a mapped safetensors file is read from disk by the page faults of the first
    copy that touches it. Copied to the device straight, as a pageable copy, those faults
    happen inside the CUDA call, and every other thread's CUDA calls wait behind it: from a
    cold disk that held up the cache's allocation, the warm-up and the compile by as long as
    the read saved (docs/PERFORMANCE.md, sessions 50 and 52). Here a host copy
    into a pinned buffer faults the pages in outside any CUDA call (and casts, on the host as
    ``from_pretrained`` does: a cast on the device would need room the KV cache may hold by
    then), and the transfer from it is queued on the current stream, running while the next
    piece is copied into the other buffer. A tensor larger than a buffer passes in pieces.
    Unpinned (a CPU model's weights) the buffers are plain and each copy immediate."""

    def __init__(self, *, pinned: bool, piece_bytes: int = STAGING_BYTES, count: int = 2):
        self._buffers = [
            torch.empty(piece_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(count)
        ]
        # Recorded after each buffer's transfer is queued; waited on before it is overwritten.
        self._transferred = [torch.cuda.Event() if pinned else None for _ in range(count)]
        self._turn = 0

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """Queue ``source`` (host, any dtype, ``destination``'s shape) into ``destination``."""
        if not destination.is_contiguous():  # no model's weight so far; copied unstaged
            destination.copy_(source.to(destination.dtype))
            return
        into, out_of = destination.view(-1), source.reshape(-1)
        piece = self._buffers[0].numel() // destination.element_size()
        for start in range(0, into.numel(), piece):
            stop = min(start + piece, into.numel())
            turn, self._turn = self._turn, (self._turn + 1) % len(self._buffers)
            transferred = self._transferred[turn]
            if transferred is not None:
                transferred.synchronize()
            staged = self._buffers[turn].view(destination.dtype)[: stop - start]
            staged.copy_(out_of[start:stop])
            into[start:stop].copy_(staged, non_blocking=True)
            if transferred is not None:
                transferred.record()


def kv_shape(attention: ModelAttention) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of the cache the model's attention layers need."""
    return attention.num_layers, attention.num_kv_heads, attention.head_dim


def num_kv_blocks(
    attention: ModelAttention, cache: CacheConfig, device: torch.device, dtype: torch.dtype
) -> int:
    """Blocks to allocate: ``--num-blocks``, else what the device has room for."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    layers, kv_heads, head_dim = kv_shape(attention)
    block_bytes = 2 * layers * cache.block_size * kv_heads * head_dim * dtype.itemsize
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * cache.kv_cache_memory_fraction
    else:
        budget = cache.cpu_kv_cache_gib * 2**30
    blocks = int(budget // block_bytes)
    if blocks < 1:
        raise RuntimeError(f"no room for a single KV block of {block_bytes} bytes on {device}")
    return blocks


def allocate_kv_cache(
    attention: ModelAttention,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> KVCache:
    layers, kv_heads, head_dim = kv_shape(attention)
    shape = ((num_blocks + 1) * block_size, kv_heads, head_dim)  # + the padding block
    keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
    values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
    log.info("KV cache: %d blocks of %d tokens, %s per layer", num_blocks, block_size, shape)
    kv_cache = KVCache(keys, values, block_size, num_blocks)
    attach_kv_cache(kv_cache, [layer.module for layer in attention.layers])
    return kv_cache
