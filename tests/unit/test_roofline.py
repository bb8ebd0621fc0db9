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
