"""The memory-bandwidth floor of decoding: what a step must read, over what the device moves.

A decode step reads every weight the forward pass multiplies by (the input embedding only
row by row, so it is left out unless it is tied to the output head) and the KV cache of
every token each sequence attends to: on a layer with a sliding window, the last ``window``
tokens at most. Its floor is those bytes over the device's measured copy bandwidth; the
benchmark sums it over the decode steps it ran (counting every layer's keys in full, as its
records hold the context summed over sequences: for models with sliding windows its floor
is too high, so their ratio to it too low).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from cbpipe.trace import StepRecord


@dataclass(frozen=True)
class DecodeBytes:
    weight_bytes: int  # read once per step
    kv_bytes_per_token: int  # read once per attended token per step, all layers
    # (window, KV bytes per token of the layers with that window): they read at most the
    # last ``window`` tokens of a sequence.
    windowed: tuple[tuple[int, int], ...] = ()

    def step_bytes(self, num_context_tokens: int) -> int:
        """Every layer reading every token (windows ignored)."""
        return self.weight_bytes + self.kv_bytes_per_token * num_context_tokens

    def step_bytes_for(self, context_lens: Iterable[int]) -> int:
        """The step of sequences of these context lengths, windows counted."""
        full = self.kv_bytes_per_token - sum(per_token for _, per_token in self.windowed)
        kv = sum(
            full * n + sum(per_token * min(n, w) for w, per_token in self.windowed)
            for n in context_lens
        )
        return self.weight_bytes + kv


def decode_bytes(
    config: PretrainedConfig, dtype: torch.dtype, windows: Sequence[int | None] = ()
) -> DecodeBytes:
    """Byte counts from the configuration alone (the model is built on the meta device).

    ``windows``: each layer's sliding window (None: none), as the worker's probe found them;
    left empty, every layer reads every token.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config()
    params = sum(p.numel() for p in model.parameters())
    if not text.tie_word_embeddings:
        params -= model.get_input_embeddings().weight.numel()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    layer_kv = 2 * kv_heads * head_dim * dtype.itemsize
    per_window: dict[int, int] = {}
    for window in windows:
        if window is not None:
            per_window[window] = per_window.get(window, 0) + layer_kv
    windowed = tuple(sorted(per_window.items()))
    return DecodeBytes(params * dtype.itemsize, text.num_hidden_layers * layer_kv, windowed)


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


def graph_replay_ms(graph: torch.cuda.CUDAGraph, iters: int) -> list[float]:
    """The device time of each of ``iters`` replays of ``graph``, in milliseconds by CUDA
    events, one replay at a time: what the benchmarks' medians are taken of."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


@dataclass(frozen=True)
class KernelTime:
    name: str
    us: float  # the kernel's device time
    gap_us: float  # from its end to the next kernel's start (0 for the last)


def graph_kernels(graph: torch.cuda.CUDAGraph) -> list[KernelTime]:
    """Each kernel of one replay of ``graph`` in launch order, as the profiler saw it."""
    from torch.autograd import DeviceType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    return [
        KernelTime(
            event.name,
            event.time_range.end - event.time_range.start,
            next_event.time_range.start - event.time_range.end if next_event else 0.0,
        )
        for event, next_event in zip(events, [*events[1:], None], strict=True)
    ]
