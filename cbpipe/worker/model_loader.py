"""Loading unmodified transformers causal LMs, and allocating their paged KV cache."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
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
    from a probe forward of the loaded model.
    """
    check_config(source.config, max_model_len)
    binding = StepBinding()
    name = register(binding)
    try:
        model = load_model(
            source, device, dtype, seed=seed, attn_implementation=name, fuse=fuse, tp=tp
        )
    except KeyError as exc:
        if exc.args and exc.args[0] == name:  # GPT-J in transformers 5.17, Falcon in any
            raise own_attention_table_error(source.config, exc) from exc
        raise
    attention = probe_model(model, binding, max_model_len)
    log.info("%s: %d attention layers, %s", source.name, attention.num_layers,
             attention.describe())  # fmt: skip
    return model, attention


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
