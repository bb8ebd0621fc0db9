"""The decode step's matrix products alone on the GPU: how close each comes to the copy rate.

    python scripts/bench_matmul.py [--model random:llama-8b] [--batch 32 256] [--json PATH]

A decode step multiplies a few rows (one per sequence) by every weight matrix, so each
product should take the time to read its weight. For each projection of one decoder layer
(q, k, v, o, gate, up, down), the output head, and the fused products a model could use
instead (q|k|v in one matrix, gate|up in one), this times ``F.linear`` at each batch size and
reports the weight bytes read per second against the device's measured copy bandwidth
(``cbpipe.roofline.copy_bandwidth``, reads plus writes: a product that only reads can pass
1.0), and the layer's total time separate against fused.

Each shape cycles through enough copies of its weight to exceed the L2 cache, as the layers of
a real model do, and the loop is replayed from a CUDA graph so launch overhead does not count.

A split-K Triton kernel for these products was swept against cuBLAS on an H200 (commit
1215f6b, docs/PERFORMANCE.md) and lost or tied on every one, so the engine keeps cuBLAS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

L2_BYTES_TO_EXCEED = 512 << 20


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each product of one layer, the head and the fusions."""
    text = config.get_text_config()
    hidden, inter = text.hidden_size, text.intermediate_size
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q": (q, hidden),
        "k": (kv, hidden),
        "v": (kv, hidden),
        "o": (hidden, q),
        "gate": (inter, hidden),
        "up": (inter, hidden),
        "down": (hidden, inter),
        "qkv": (q + 2 * kv, hidden),
        "gate_up": (2 * inter, hidden),
        "lm_head": (text.vocab_size, hidden),
    }


Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def time_product(
    rows: int, shape: tuple[int, int], dtype: torch.dtype, iters: int, product: Product = F.linear
) -> float:
    """Median seconds of one ``product(x, w)`` of ``rows`` rows by a weight of ``shape``."""
    out_features, in_features = shape
    weight_bytes = out_features * in_features * dtype.itemsize
    copies = max(2, min(64, -(-L2_BYTES_TO_EXCEED // weight_bytes)))
    weights = [torch.randn(shape, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, in_features, device="cuda", dtype=dtype)
    for w in weights:  # warm up heuristics, workspaces and compilation before capture
        product(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            product(x, w)
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / copies)
    del graph, weights
    torch.cuda.empty_cache()
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_matmul needs a CUDA device", file=sys.stderr)
        return 2

    from cbpipe.models import resolve_model
    from cbpipe.roofline import copy_bandwidth

    dtype = torch.bfloat16
    config = resolve_model(args.model).config
    bandwidth = copy_bandwidth(torch.device("cuda"))
    shapes = projection_shapes(config)
    print(
        f"{args.model}, bf16, {torch.cuda.get_device_name()}, copy bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s, torch {torch.__version__}"
    )
    results = []
    for rows in args.batch:
        print(f"\nbatch {rows}")
        print(f"{'product':>8} {'out x in':>14} {'MB':>7} {'us':>8} {'GB/s':>7} {'x copy':>7}")
        times = {}
        for name, shape in shapes.items():
            seconds = time_product(rows, shape, dtype, args.iters)
            nbytes = shape[0] * shape[1] * dtype.itemsize
            times[name] = seconds
            rate = nbytes / seconds
            print(
                f"{name:>8} {shape[0]:>6} x {shape[1]:<6} {nbytes / 2**20:>7.1f} "
                f"{seconds * 1e6:>8.1f} {rate / 1e9:>7.0f} {rate / bandwidth:>7.2f}"
            )
            results.append(
                {
                    "batch": rows,
                    "product": name,
                    "shape": shape,
                    "seconds": seconds,
                    "bytes": nbytes,
                    "bytes_per_second": rate,
                }
            )
        layers = config.get_text_config().num_hidden_layers
        separate = sum(times[n] for n in ("q", "k", "v", "o", "gate", "up", "down"))
        fused = sum(times[n] for n in ("qkv", "o", "gate_up", "down"))
        layer_bytes = sum(shapes[n][0] * shapes[n][1] for n in ("qkv", "o", "gate_up", "down"))
        floor = layer_bytes * dtype.itemsize / bandwidth
        print(
            f"one layer: separate {separate * 1e6:.1f} us, fused {fused * 1e6:.1f} us, "
            f"at the copy rate {floor * 1e6:.1f} us; x{layers} layers + head: separate "
            f"{(separate * layers + times['lm_head']) * 1e3:.2f} ms, fused "
            f"{(fused * layers + times['lm_head']) * 1e3:.2f} ms"
        )
    if args.json:
        with open(args.json, "w") as f:
            summary = {"model": args.model, "copy_bandwidth": bandwidth, "results": results}
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
