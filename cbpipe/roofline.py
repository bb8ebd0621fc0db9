"""The memory-bandwidth floor of decoding: what a step must read, over what the device moves.

A decode step reads every weight the forward pass multiplies by (the input embedding only
row by row, so it is left out unless it is tied to the output head) and the KV cache of
every token each sequence attends to. Its floor is those bytes over the device's measured
copy bandwidth; the benchmark sums it over the decode steps it ran.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from cbpipe.trace import StepRecord


@dataclass(frozen=True)
class DecodeBytes:
    weight_bytes: int  # read once per step
    kv_bytes_per_token: int  # read once per attended token per step

    def step_bytes(self, num_context_tokens: int) -> int:
        return self.weight_bytes + self.kv_bytes_per_token * num_context_tokens


def decode_bytes(config: PretrainedConfig, dtype: torch.dtype) -> DecodeBytes:
    """Byte counts from the configuration alone (the model is built on the meta device)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config()
    params = sum(p.numel() for p in model.parameters())
    if not text.tie_word_embeddings:
        params -= model.get_input_embeddings().weight.numel()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * dtype.itemsize
    return DecodeBytes(params * dtype.itemsize, kv_per_token)


def floor_seconds(
    records: Iterable[StepRecord], sizes: DecodeBytes, bytes_per_second: float
) -> float:
    return sum(sizes.step_bytes(r.num_context_tokens) for r in records) / bytes_per_second


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Best device-to-device copy rate in bytes per second, counting reads and writes."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * nbytes / best
