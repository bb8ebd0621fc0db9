"""Decode attention alone on the GPU: the Triton paged kernel against gather-then-SDPA.

    python scripts/bench_attention.py [--json PATH] [--sweep]

Shapes are Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128, bf16, block size
16), at batch 32 and at batch 256 (a 1B-class model has the same head layout), with every
sequence at 512, 2048 or 8192 tokens; blocks are shuffled so pages are scattered as in a long-
running server. Two implementations:

* ``triton``: ``paged_decode_attention`` with its default split count.
* ``gather+sdpa``: the plain torch path of ``cbpipe.worker.attention._attend`` for decode rows:
  gather each sequence's keys and values into ``[S, max_k, KVH, D]``, fold the query heads of
  a KV head into query rows, and call SDPA (flash, efficient or math) with a boolean mask. The
  gather index is built outside the timed region (the engine builds it once per step for all
  layers); the gather itself is timed.

Each case reports the median of ``--iters`` CUDA-event timings (the L2 is flushed before
each), the KV bytes read per call over that time, and that rate over the device's measured
copy bandwidth (``cbpipe.roofline.copy_bandwidth``, which counts reads plus writes, so a
kernel that only reads can pass 1.0). A last section times the kernel at batch 32, context
2048, launched eagerly against replayed from a CUDA graph, with the host time of one eager
call, which is what graphs remove. ``--sweep`` also times the kernel over
tile sizes, warps, stages and split counts, to pick the module's launch constants.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_SPIN_CYCLES = 2_000_000  # about 1 ms at H200 clocks: longer than any launch overhead


@dataclass
class Problem:
    query: torch.Tensor  # [S, H, D]
    key_cache: torch.Tensor  # [slots, KVH, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # flat int32
    width: torch.Tensor  # one int64 element
    context_lens: torch.Tensor  # [S] int32
    kv_index: torch.Tensor  # [S, max_k] int64, for the torch path
    key_valid: torch.Tensor  # [S, 1, 1, max_k] bool

    @property
    def scale(self) -> float:
        return HEAD_DIM**-0.5


@dataclass
class Row:
    impl: str
    batch: int
    context: int
    ms: float
    kv_gb_per_s: float
    of_copy_bandwidth: float
    num_splits: int | None = None


def make_problem(batch: int, context: int, device: torch.device) -> Problem:
    width = -(-context // BLOCK_SIZE)
    num_blocks = batch * width
    slots = num_blocks * BLOCK_SIZE
    key_cache = torch.randn(slots, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    value_cache = torch.randn_like(key_cache)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32)
    header = torch.tensor([0, width], dtype=torch.int64, device=device)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    key_pos = torch.arange(context, device=device)
    table_2d = tables.view(batch, width).long()
    kv_index = table_2d[:, key_pos // BLOCK_SIZE] * BLOCK_SIZE + key_pos % BLOCK_SIZE
    key_valid = (key_pos[None, :] < context_lens[:, None])[:, None, None, :]
    return Problem(
        query, key_cache, value_cache, tables, header[1:], context_lens, kv_index, key_valid
    )


def triton_attention(p: Problem, num_splits: int | None = None) -> torch.Tensor:
    from cbpipe.worker.kernels.paged_decode import paged_decode_attention

    return paged_decode_attention(
        p.query,
        p.key_cache,
        p.value_cache,
        p.block_tables,
        p.width,
        p.context_lens,
        block_size=BLOCK_SIZE,
        scale=p.scale,
        num_splits=num_splits,
    )


def gather_sdpa_attention(p: Problem) -> torch.Tensor:
    """The decode branch of ``cbpipe.worker.attention._attend`` (one query row per sequence)."""
    num_seqs = p.query.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    q = p.query.view(num_seqs, NUM_KV_HEADS, group, HEAD_DIM)  # rows: the group's heads
    k = p.key_cache[p.kv_index].transpose(1, 2)  # [S, KVH, max_k, D]
    v = p.value_cache[p.kv_index].transpose(1, 2)
    with sdpa_kernel(_BACKENDS):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=p.key_valid, scale=p.scale)
    return out.reshape(num_seqs, NUM_HEADS, HEAD_DIM)


def time_ms(fn: Callable[[], object], iters: int, flush: torch.Tensor, spin: bool = True) -> float:
    """Median CUDA-event time of ``fn``, the L2 flushed before each call.

    A spin kernel queued ahead of the start event keeps the GPU busy while the host launches
    ``fn``, so the time is the device's, not the Python launch overhead (timed separately).
    """
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        if spin:
            torch.cuda._sleep(_SPIN_CYCLES)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kv_bytes(batch: int, context: int) -> int:
    # Keys and values, one layer, every attended token.
    return 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize * batch * context


def row(impl: str, batch: int, context: int, ms: float, copy_bw: float, **extra: int) -> Row:
    rate = kv_bytes(batch, context) / (ms / 1e3)
    return Row(impl, batch, context, ms, rate / 1e9, rate / copy_bw, **extra)


def graph_vs_eager(device: torch.device, iters: int) -> dict[str, float]:
    """Kernel at batch 32, context 2048: eager launches against one captured graph's replays."""
    p = make_problem(32, 2048, device)
    calls = 50

    def eager() -> None:
        for _ in range(calls):
            triton_attention(p)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_attention(p)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            triton_attention(p)

    def host_us(num_splits: int | None) -> float:
        triton_attention(p, num_splits)  # compiles a split count not seen yet
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            triton_attention(p, num_splits)
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed / 200 * 1e6

    # Back-to-back calls with no spin ahead: eager launches are exposed as they would be in
    # a model's forward pass, graph replays are not.
    no_flush = torch.empty(0, device=device)
    return {
        "eager_ms_per_call": time_ms(eager, iters, no_flush, spin=False) / calls,
        "graph_ms_per_call": time_ms(graph.replay, iters, no_flush, spin=False) / calls,
        "host_us_per_call": host_us(None),
        "host_us_per_call_two_splits": host_us(2),
    }


def sweep(device: torch.device, iters: int, flush: torch.Tensor) -> list[dict[str, object]]:
    """The kernel over launch settings, for the module's constants (module attributes)."""
    import cbpipe.worker.kernels.paged_decode as kernel

    saved = (kernel._MAX_BLOCK_N, kernel._NUM_WARPS, kernel._NUM_STAGES)
    results = []
    for batch, context in [(4, 8192), (32, 2048), (32, 8192), (256, 512), (256, 2048)]:
        p = make_problem(batch, context, device)
        print(f"sweep batch {batch} context {context}", flush=True)
        for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
            kernel._MAX_BLOCK_N, kernel._NUM_WARPS, kernel._NUM_STAGES = block_n, warps, stages
            for splits in (1, 2, 3, 4, 8, 16, 32):
                ms = time_ms(lambda p=p, s=splits: triton_attention(p, s), iters, flush)
                gbs = kv_bytes(batch, context) / ms / 1e6
                results.append(
                    dict(batch=batch, context=context, block_n=block_n, warps=warps)
                    | dict(stages=stages, splits=splits, ms=ms, kv_gb_per_s=gbs)
                )
        del p
        best = sorted(
            (r for r in results if r["batch"] == batch and r["context"] == context),
            key=lambda r: r["ms"],
        )[:5]
        for r in best:
            print("  ", r, flush=True)
    kernel._MAX_BLOCK_N, kernel._NUM_WARPS, kernel._NUM_STAGES = saved
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="32,256")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also sweep the kernel's settings")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA device; none is available")

    import triton

    from cbpipe.roofline import copy_bandwidth
    from cbpipe.worker.kernels.paged_decode import default_num_splits

    device = torch.device("cuda")
    copy_bw = copy_bandwidth(device)
    # Larger than the L2 (50-60 MB on Hopper), so a flush evicts the previous call's KV.
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    print(
        f"{torch.cuda.get_device_name(device)}: torch {torch.__version__}, "
        f"triton {triton.__version__}, copy bandwidth {copy_bw / 1e9:.0f} GB/s",
        flush=True,
    )

    rows: list[Row] = []
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            p = make_problem(batch, context, device)
            err = (triton_attention(p).float() - gather_sdpa_attention(p).float()).abs().max()
            if err.item() > 2e-2:
                sys.exit(f"batch {batch} context {context}: the two paths differ by {err:.3g}")
            splits = default_num_splits(batch, NUM_KV_HEADS, device)
            ms = time_ms(lambda p=p: triton_attention(p), args.iters, flush)
            rows.append(row("triton", batch, context, ms, copy_bw, num_splits=splits))
            ms = time_ms(lambda p=p: gather_sdpa_attention(p), args.iters, flush)
            rows.append(row("gather+sdpa", batch, context, ms, copy_bw))
            del p
            torch.cuda.empty_cache()

    print(
        f"\n{'impl':<12} {'batch':>5} {'context':>7} {'splits':>6} {'ms':>9} {'KV GB/s':>8} "
        f"{'of copy bw':>10}"
    )
    for r in rows:
        splits = "" if r.num_splits is None else str(r.num_splits)
        print(
            f"{r.impl:<12} {r.batch:>5} {r.context:>7} {splits:>6} {r.ms:>9.4f} "
            f"{r.kv_gb_per_s:>8.0f} {r.of_copy_bandwidth:>10.2f}"
        )
    for batch, context in sorted({(r.batch, r.context) for r in rows}):
        ms = {r.impl: r.ms for r in rows if (r.batch, r.context) == (batch, context)}
        print(
            f"batch {batch} context {context}: triton is "
            f"{ms['gather+sdpa'] / ms['triton']:.1f}x faster than gather+sdpa"
        )

    graph = graph_vs_eager(device, args.iters)
    print(
        f"\nbatch 32 context 2048, per call: eager {graph['eager_ms_per_call'] * 1e3:.1f} us, "
        f"CUDA graph replay {graph['graph_ms_per_call'] * 1e3:.1f} us; host time per eager "
        f"call {graph['host_us_per_call']:.1f} us ({graph['host_us_per_call_two_splits']:.1f} "
        "us forced to two splits: a merge launch and scratch buffers more)"
    )

    sweep_rows = sweep(device, max(5, args.iters // 2), flush) if args.sweep else None
    if args.json:
        report = {
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "copy_bandwidth_bytes_per_s": copy_bw,
            "rows": [asdict(r) for r in rows],
            "graph_vs_eager": graph,
            "sweep": sweep_rows,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
