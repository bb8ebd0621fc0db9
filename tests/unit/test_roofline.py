import torch

from cbpipe.models import resolve_model
from cbpipe.roofline import decode_bytes, floor_seconds
from cbpipe.trace import StepRecord


def test_llama_8b_decode_bytes_match_a_count_by_hand() -> None:
    sizes = decode_bytes(resolve_model("random:llama-8b").config, torch.bfloat16)
    hidden, layers, inter, vocab, kv = 4096, 32, 14336, 128256, 8 * 128
    matrices = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter)
    norms = layers * 2 * hidden + hidden
    # The untied input embedding is only looked up row by row; the output head is read.
    assert sizes.weight_bytes == 2 * (matrices + norms + vocab * hidden)
    assert sizes.kv_bytes_per_token == 2 * layers * kv * 2


def test_tied_embeddings_count_once() -> None:
    config = resolve_model("random:llama-1b").config
    sizes = decode_bytes(config, torch.bfloat16)
    hidden, layers, inter, vocab, kv = 2048, 16, 8192, 128256, 8 * 64
    matrices = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter)
    assert sizes.weight_bytes == 2 * (matrices + layers * 2 * hidden + hidden + vocab * hidden)


def test_floor_sums_weights_and_attended_kv_over_steps() -> None:
    sizes = decode_bytes(resolve_model("random:llama-1b").config, torch.bfloat16)
    steps = [StepRecord(i, 2, 2, 2, 100 + i, 0, 0, 0, 0, 0, 0) for i in range(3)]
    total = 3 * sizes.weight_bytes + sizes.kv_bytes_per_token * (100 + 101 + 102)
    assert abs(floor_seconds(steps, sizes, 1e12) - total / 1e12) < 1e-12


def test_sliding_window_layers_read_at_most_their_window() -> None:
    """Gemma 2 2B: 13 layers with a window of 4096, 13 without; 4 KV heads of 256, bf16."""
    config = resolve_model("random:gemma2-2b").config
    windows = [4096 if i % 2 == 0 else None for i in range(26)]
    sizes = decode_bytes(config, torch.bfloat16, windows)
    layer_kv = 2 * 4 * 256 * 2
    assert sizes.kv_bytes_per_token == 26 * layer_kv
    assert sizes.windowed == ((4096, 13 * layer_kv),)
    contexts = [8192, 100]
    kv = 13 * layer_kv * (8192 + 100) + 13 * layer_kv * (4096 + 100)
    assert sizes.step_bytes_for(contexts) == sizes.weight_bytes + kv
    assert sizes.step_bytes(8192 + 100) == sizes.weight_bytes + 26 * layer_kv * 8292
