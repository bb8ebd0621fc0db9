"""Loading unmodified transformers causal LMs, and allocating their paged KV cache."""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from cbpipe.config import CacheConfig
from cbpipe.models import ModelSource
from cbpipe.worker.attention import KVCache
from cbpipe.worker.fused_projections import fuse_projections

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
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
    attn_implementation: str = "sdpa",
    fuse: bool = False,
) -> PreTrainedModel:
    """The model in eval mode on ``device``; presets get seeded random weights made there.

    ``fuse`` joins sibling projections into one product each (``fused_projections``).
    """
    if source.path is None:
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


def kv_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers decoder config."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def num_kv_blocks(
    model: PreTrainedModel, cache: CacheConfig, device: torch.device, dtype: torch.dtype
) -> int:
    """Blocks to allocate: ``--num-blocks``, else what the device has room for."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    layers, kv_heads, head_dim = kv_shape(model)
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
    model: PreTrainedModel,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> KVCache:
    layers, kv_heads, head_dim = kv_shape(model)
    shape = ((num_blocks + 1) * block_size, kv_heads, head_dim)  # + the padding block
    keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
    values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
    log.info("KV cache: %d blocks of %d tokens, %s per layer", num_blocks, block_size, shape)
    return KVCache(keys, values, block_size, num_blocks)
