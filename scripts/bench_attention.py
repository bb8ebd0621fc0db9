"""Decode and prefill attention alone on the GPU: the Triton paged kernels against gather+SDPA.

    python scripts/bench_attention.py [--json PATH] [--sweep] [--sweep-cases 256x640,...]
                                      [--head-dim 64] [--no-decode] [--no-prefill]
                                      [--prefill-sweep] [--self-check]

Shapes are Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128, bf16, block size
16), at batch 32 and at batch 256 (a 1B-class model has the same head layout), with every
sequence at 512, 2048 or 8192 tokens; blocks are shuffled so pages are scattered as in a long-
running server. Two implementations:

* ``triton``: ``paged_decode_attention`` with its default split count.
* ``gather+sdpa``: the engine's plain torch path for decode rows
  (``cbpipe.worker.attention.GatheredRows`` from ``PagedStep.build``): gather
  each sequence's keys and values into ``[S, max_k, KVH, D]``, fold the query heads of a KV
  head into query rows, and call SDPA (flash, efficient or math) with a boolean mask. The
  gather index is built outside the timed region (the engine builds it once per step for all
  layers); the gather itself is timed.

Each case reports the median of ``--iters`` CUDA-event timings (the L2 is flushed before
each), the KV bytes read per call over that time, and that rate over the device's measured
copy bandwidth (``cbpipe.roofline.copy_bandwidth``, which counts reads plus writes, so a
kernel that only reads can pass 1.0). A last section times the kernel at batch 32, context
2048, launched eagerly against replayed from a CUDA graph, with the host time of one eager
call, which is what graphs remove. ``--sweep`` also times the kernel over
KV heads per program, tile sizes, warps, stages and split counts, to pick the module's launch
constants, at ``--sweep-cases``. ``--head-dim 64`` gives the decode cases Llama-3.2-1B's head
size (the same 32 query and 8 KV heads).

Prefill (``--no-prefill`` skips it, ``--no-decode`` skips everything above) is timed at
Llama-3.2-1B's attention (32 query heads, 8 KV heads, head_dim 64, bf16, block size 16) on
three steps of 2048 new tokens: one sequence of 2048 (context 2048); four of 512 new tokens
after 512 cached ones (context 1024, chunked prefill); two of 1024 (context 1024). Again two
implementations:

* ``triton``: ``paged_prefill_attention`` (``kernels/paged_prefill.py``) with its defaults.
* ``gather+sdpa``: ``cbpipe.worker.attention.GatheredRows.attend`` for a prefill group, with
  the scatter back to packed rows: gather the query rows to ``[P, max_q]`` and the keys and
  values to ``[P, max_k]``, fold the query heads of a KV head into query rows, SDPA (flash,
  efficient or math) with the boolean mask ``[P, 1, G * max_q, max_k]``. The indices and the
  mask are built outside the timed region, as ``PagedStep.build`` builds them once per step.

Each reports the median time, the attention TFLOP/s of the causal work (the visible
(query, key) pairs, 4 * heads * head_dim flops each) and the speed-up, and the time times
16 (the 1B model's layers), to set against the 20-25 ms of a whole 2048-token prefill step.
``--prefill-sweep`` times the prefill kernel over its tiles, warps and stages.
``--self-check`` runs the prefill comparison at tiny sizes and exits: on a GPU if there is
one, else on the CPU under Triton's interpreter (so the code path is checked without a GPU).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from cbpipe.worker.attention import GatheredRows

# cbpipe.worker.attention imports transformers, which imports triton: it is imported where
# used, after --self-check may have set TRITON_INTERPRET (triton reads it when imported).

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
_SPIN_CYCLES = 2_000_000  # about 1 ms at H200 clocks: longer than any launch overhead
# Prefill shapes: Llama-3.2-1B's attention, 16 layers.
PREFILL_HEADS, PREFILL_KV_HEADS, PREFILL_HEAD_DIM, PREFILL_LAYERS = 32, 8, 64, 16
# (sequences, new tokens per sequence, context per sequence: cached plus new)
PREFILL_CASES = [(1, 2048, 2048), (4, 512, 1024), (2, 1024, 1024)]
# --self-check: the same code path at sizes Triton's CPU interpreter gets through quickly.
SELF_CHECK_CASES = [(1, 40, 40), (3, 9, 29), (2, 33, 33)]


@dataclass
class Problem:
    query: torch.Tensor  # [S, H, D]
    key_cache: torch.Tensor  # [slots, KVH, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # flat int32
    width: torch.Tensor  # one int64 element
    context_lens: torch.Tensor  # [S] int32
    gathered: GatheredRows  # the torch path's indices and masks, from PagedStep.build

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5


@dataclass
class Row:
    impl: str
    batch: int
    context: int
    ms: float
    kv_gb_per_s: float
    of_copy_bandwidth: float
    num_splits: int | None = None


def make_problem(
    batch: int, context: int, device: torch.device, head_dim: int = HEAD_DIM
) -> Problem:
    from cbpipe.worker.attention import GatheredRows, KVCache, PagedStep

    width = -(-context // BLOCK_SIZE)
    num_blocks = batch * width
    slots = num_blocks * BLOCK_SIZE
    key_cache = torch.randn(slots, NUM_KV_HEADS, head_dim, dtype=DTYPE, device=device)
    value_cache = torch.randn_like(key_cache)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32)
    header = torch.tensor([0, width], dtype=torch.int64, device=device)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, NUM_HEADS, head_dim, dtype=DTYPE, device=device)
    paged = PagedStep.build(
        KVCache([key_cache], [value_cache], BLOCK_SIZE, num_blocks),
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),  # not written here
        positions=(context_lens - 1).long(),
        query_start=torch.arange(batch + 1, dtype=torch.int32, device=device),
        context_lens=context_lens,
        block_tables=tables.view(batch, width),
        block_table_width=header[1:],
        num_single_token_seqs=batch,
        max_query_len=1,
        max_context_len=context,
        kv_group_size=NUM_HEADS // NUM_KV_HEADS,
        decode_kernel=None,
    )
    (gathered,) = paged.groups
    assert isinstance(gathered, GatheredRows)
    return Problem(query, key_cache, value_cache, tables, header[1:], context_lens, gathered)


def triton_attention(
    p: Problem, num_splits: int | None = None, heads_per_program: int | None = None
) -> torch.Tensor:
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
        heads_per_program=heads_per_program,
    )


def gather_sdpa_attention(p: Problem) -> torch.Tensor:
    """The engine's torch path for decode rows (``GatheredRows.attend``)."""
    from cbpipe.worker.attention import AttentionVariant

    out = torch.empty_like(p.query)
    p.gathered.attend(AttentionVariant(p.scale), p.query, p.key_cache, p.value_cache, out)
    return out


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


def kv_bytes(batch: int, context: int, head_dim: int = HEAD_DIM) -> int:
    # Keys and values, one layer, every attended token.
    return 2 * NUM_KV_HEADS * head_dim * DTYPE.itemsize * batch * context


def row(
    impl: str, batch: int, context: int, ms: float, copy_bw: float, head_dim: int, **extra: int
) -> Row:
    rate = kv_bytes(batch, context, head_dim) / (ms / 1e3)
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


# (batch, context) pairs of --sweep, unless --sweep-cases names others.
SWEEP_CASES = "4x8192,32x2048,32x8192,256x512,256x2048"


def sweep(
    device: torch.device, iters: int, flush: torch.Tensor, cases: str, head_dim: int
) -> list[dict[str, object]]:
    """The kernel over launch settings, for the module's constants (module attributes)."""
    import cbpipe.worker.kernels.paged_decode as kernel

    saved = (kernel._MAX_BLOCK_N, kernel._NUM_WARPS, kernel._NUM_STAGES, kernel._TILE_BYTES)
    kernel._TILE_BYTES = 1 << 20  # the tile is _MAX_BLOCK_N; one too large for memory fails
    # Heads per program up to a packed head of 256 dims (1 alone at head_dim 256).
    packs = [pack for pack in (1, 2, 4, 8) if pack == 1 or pack * head_dim <= 256]
    results = []
    for case in cases.split(","):
        batch, context = map(int, case.split("x"))
        p = make_problem(batch, context, device, head_dim)
        print(f"sweep batch {batch} context {context} head_dim {head_dim}", flush=True)
        settings = itertools.product(packs, (32, 64, 128), (2, 4, 8), (2, 3))
        for pack, block_n, warps, stages in settings:
            kernel._MAX_BLOCK_N, kernel._NUM_WARPS, kernel._NUM_STAGES = block_n, warps, stages
            for splits in (1, 2, 4) if batch >= 64 else (1, 2, 4, 8, 16):
                try:
                    ms = time_ms(
                        lambda p=p, s=splits, h=pack: triton_attention(p, s, h), iters, flush
                    )
                except Exception as error:  # noqa: BLE001 (a setting that does not fit: skip it)
                    print(f"   pack {pack} block_n {block_n} warps {warps} stages {stages}: "
                          f"{error!r:.120}")  # fmt: skip
                    break
                gbs = kv_bytes(batch, context, head_dim) / ms / 1e6
                results.append(
                    dict(batch=batch, context=context, pack=pack, block_n=block_n, warps=warps)
                    | dict(stages=stages, splits=splits, ms=ms, kv_gb_per_s=gbs)
                )
        del p
        best = sorted(
            (r for r in results if r["batch"] == batch and r["context"] == context),
            key=lambda r: r["ms"],
        )[:5]
        for r in best:
            print("  ", r, flush=True)
    kernel._MAX_BLOCK_N, kernel._NUM_WARPS, kernel._NUM_STAGES, kernel._TILE_BYTES = saved
    return results


@dataclass
class PrefillProblem:
    query: torch.Tensor  # [rows, H, D], the sequences' new rows packed
    key_cache: torch.Tensor  # [slots, KVH, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, width] int32
    query_start: torch.Tensor  # [S + 1] int32
    context_lens: torch.Tensor  # [S] int32
    max_query_len: int
    # The torch path's per-step metadata, from PagedStep.build.
    gathered: GatheredRows  # with the (sequence, offset) of each packed row

    @property
    def scale(self) -> float:
        return PREFILL_HEAD_DIM**-0.5


@dataclass
class PrefillRow:
    impl: str
    seqs: int
    new_tokens: int  # per sequence
    context: int  # per sequence
    ms: float
    tflops: float  # of the causal attention's useful work


def make_prefill_problem(
    num_seqs: int, new: int, context: int, device: torch.device, dtype: torch.dtype = DTYPE
) -> PrefillProblem:
    from cbpipe.worker.attention import GatheredRows, KVCache, PagedStep

    width = -(-context // BLOCK_SIZE)
    num_blocks = num_seqs * width
    shape = (num_blocks * BLOCK_SIZE, PREFILL_KV_HEADS, PREFILL_HEAD_DIM)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(num_seqs, width)
    query_start = (torch.arange(num_seqs + 1, device=device) * new).to(torch.int32)
    context_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    num_rows = num_seqs * new
    query = torch.randn(num_rows, PREFILL_HEADS, PREFILL_HEAD_DIM, dtype=dtype, device=device)
    # Each sequence's new rows are its last positions.
    positions = (context - new + torch.arange(num_rows, device=device) % new).long()

    paged = PagedStep.build(
        KVCache([key_cache], [value_cache], BLOCK_SIZE, num_blocks),
        slot_mapping=torch.zeros(num_rows, dtype=torch.int64, device=device),  # not written
        positions=positions,
        query_start=query_start,
        context_lens=context_lens,
        block_tables=tables,
        block_table_width=torch.tensor([width], device=device),
        num_single_token_seqs=0,
        max_query_len=new,
        max_context_len=context,
        kv_group_size=PREFILL_HEADS // PREFILL_KV_HEADS,
        decode_kernel=None,
    )
    (gathered,) = paged.groups
    assert isinstance(gathered, GatheredRows)
    return PrefillProblem(
        query,
        key_cache,
        value_cache,
        tables,
        query_start,
        context_lens,
        new,
        gathered,
    )


def triton_prefill(
    p: PrefillProblem,
    block_rows: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    from cbpipe.worker.kernels.paged_prefill import paged_prefill_attention

    return paged_prefill_attention(
        p.query,
        p.key_cache,
        p.value_cache,
        p.block_tables,
        p.query_start,
        p.context_lens,
        block_size=BLOCK_SIZE,
        scale=p.scale,
        max_query_len=p.max_query_len,
        block_rows=block_rows,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def gather_sdpa_prefill(p: PrefillProblem) -> torch.Tensor:
    """The engine's torch path for prefill rows: ``GatheredRows.attend``, with the scatter."""
    from cbpipe.worker.attention import AttentionVariant

    out = torch.empty_like(p.query)
    p.gathered.attend(AttentionVariant(p.scale), p.query, p.key_cache, p.value_cache, out)
    return out


def prefill_flops(seqs: int, new: int, context: int) -> int:
    # Row j of a chunk sees context - new + j + 1 keys; QK^T and PV, 2 flops per multiply-add.
    pairs = new * (context - new) + new * (new + 1) // 2
    return 4 * PREFILL_HEADS * PREFILL_HEAD_DIM * pairs * seqs


def prefill_mismatch(p: PrefillProblem) -> tuple[float, float]:
    """Largest difference of the two paths, absolute and beyond a bf16 unit (2^-7) of size."""
    a = triton_prefill(p).float()
    b = gather_sdpa_prefill(p).float()
    err = (a - b).abs()
    return err.max().item(), (err - 2.0**-7 * b.abs()).max().item()


def self_check() -> None:
    """The prefill comparison at tiny sizes, plus the float32 reference; exits on a mismatch."""
    from cbpipe.worker.kernels.paged_prefill import paged_prefill_reference

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    failed = False
    for seqs, new, context in SELF_CHECK_CASES:
        p = make_prefill_problem(seqs, new, context, device)
        want = paged_prefill_reference(
            p.query,
            p.key_cache,
            p.value_cache,
            p.block_tables,
            p.query_start,
            p.context_lens,
            block_size=BLOCK_SIZE,
            scale=p.scale,
            max_query_len=p.max_query_len,
        )
        to_ref = {
            impl: (fn(p).float() - want).abs().max().item()
            for impl, fn in (("triton", triton_prefill), ("gather+sdpa", gather_sdpa_prefill))
        }
        err, scaled = prefill_mismatch(p)
        ok = scaled <= 1e-2 and max(to_ref.values()) <= 3e-2
        failed |= not ok
        print(
            f"{seqs} x {new} new, context {context} on {device}: triton vs gather+sdpa "
            f"{err:.3g}, vs the float32 reference {to_ref['triton']:.3g} (gather+sdpa "
            f"{to_ref['gather+sdpa']:.3g}): {'ok' if ok else 'MISMATCH'}",
            flush=True,
        )
    if failed:
        sys.exit("self-check failed")


def prefill_section(device: torch.device, iters: int, flush: torch.Tensor) -> list[PrefillRow]:
    rows: list[PrefillRow] = []
    for seqs, new, context in PREFILL_CASES:
        p = make_prefill_problem(seqs, new, context, device)
        err, scaled = prefill_mismatch(p)
        if scaled > 1e-2:
            sys.exit(f"prefill {seqs} x {new} context {context}: paths differ by {err:.3g}")
        flops = prefill_flops(seqs, new, context)
        for impl, fn in (("triton", triton_prefill), ("gather+sdpa", gather_sdpa_prefill)):
            ms = time_ms(functools.partial(fn, p), iters, flush)
            rows.append(PrefillRow(impl, seqs, new, context, ms, flops / (ms / 1e3) / 1e12))
        del p
        torch.cuda.empty_cache()

    print(
        f"\nprefill ({PREFILL_HEADS} heads, {PREFILL_KV_HEADS} KV heads, head_dim "
        f"{PREFILL_HEAD_DIM}, bf16, block {BLOCK_SIZE}), one layer:\n"
        f"{'impl':<12} {'seqs':>4} {'new':>5} {'context':>7} {'ms':>9} {'TFLOP/s':>8}"
    )
    for r in rows:
        print(
            f"{r.impl:<12} {r.seqs:>4} {r.new_tokens:>5} {r.context:>7} {r.ms:>9.4f} "
            f"{r.tflops:>8.1f}"
        )
    for seqs, new, context in PREFILL_CASES:
        key = (seqs, new, context)
        by_impl = {r.impl: r.ms for r in rows if (r.seqs, r.new_tokens, r.context) == key}
        triton_ms, torch_ms = by_impl["triton"], by_impl["gather+sdpa"]
        print(
            f"{seqs} x {new} new, context {context}: triton is {torch_ms / triton_ms:.1f}x "
            f"faster than gather+sdpa; x{PREFILL_LAYERS} layers: "
            f"{triton_ms * PREFILL_LAYERS:.2f} ms against {torch_ms * PREFILL_LAYERS:.2f} ms"
        )
    return rows


def prefill_sweep(device: torch.device, iters: int, flush: torch.Tensor) -> list[dict[str, Any]]:
    """The prefill kernel over launch settings (its keyword overrides); failed launches skipped."""
    results: list[dict[str, Any]] = []
    for seqs, new, context in PREFILL_CASES:
        p = make_prefill_problem(seqs, new, context, device)
        flops = prefill_flops(seqs, new, context)
        print(f"prefill sweep {seqs} x {new} new, context {context}", flush=True)
        for rows, block_n, warps, stages in itertools.product(
            (8, 16, 32, 64), (32, 64, 128), (4, 8), (1, 2, 3)
        ):
            launch = dict(block_rows=rows, block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                ms = time_ms(functools.partial(triton_prefill, p, **launch), iters, flush)
            except Exception as exc:  # e.g. out of shared memory or registers for this tile
                print(f"   {launch}: {type(exc).__name__}", flush=True)
                continue
            tflops = flops / (ms / 1e3) / 1e12
            results.append(
                dict(seqs=seqs, new_tokens=new, context=context)
                | launch
                | dict(ms=ms, tflops=tflops)
            )
        del p
        best = sorted(
            (r for r in results if (r["seqs"], r["new_tokens"]) == (seqs, new)),
            key=lambda r: r["ms"],
        )[:5]
        for r in best:
            print("  ", r, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="32,256")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also sweep the kernel's settings")
    parser.add_argument(
        "--sweep-cases", default=SWEEP_CASES, help="BATCHxCONTEXT pairs the sweep times"
    )
    parser.add_argument(
        "--head-dim",
        type=int,
        default=HEAD_DIM,
        help="the decode cases' head size (64: Llama-3.2-1B's, with the same 32/8 heads)",
    )
    parser.add_argument(
        "--decode", action=argparse.BooleanOptionalAction, default=True, help="decode cases"
    )
    parser.add_argument(
        "--prefill", action=argparse.BooleanOptionalAction, default=True, help="prefill cases"
    )
    parser.add_argument(
        "--prefill-sweep", action="store_true", help="also sweep the prefill kernel's settings"
    )
    parser.add_argument(
        "--self-check",
        action="store_true",
        help="only check the prefill paths at tiny sizes (CPU: under Triton's interpreter)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args()
    if args.self_check:
        if not torch.cuda.is_available():
            # Must precede the kernel module's import, whose decorators read it.
            os.environ["TRITON_INTERPRET"] = "1"
        self_check()
        return
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA device; none is available")

    import triton

    from cbpipe.roofline import copy_bandwidth
    from cbpipe.worker.kernels.paged_decode import launch_grid

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
    for batch in map(int, args.batches.split(",")) if args.decode else ():
        for context in map(int, args.contexts.split(",")):
            p = make_problem(batch, context, device, args.head_dim)
            err = (triton_attention(p).float() - gather_sdpa_attention(p).float()).abs().max()
            if err.item() > 2e-2:
                sys.exit(f"batch {batch} context {context}: the two paths differ by {err:.3g}")
            _, splits = launch_grid(batch, p.key_cache, p.value_cache, device)
            ms = time_ms(lambda p=p: triton_attention(p), args.iters, flush)
            rows.append(
                row("triton", batch, context, ms, copy_bw, args.head_dim, num_splits=splits)
            )
            ms = time_ms(lambda p=p: gather_sdpa_attention(p), args.iters, flush)
            rows.append(row("gather+sdpa", batch, context, ms, copy_bw, args.head_dim))
            del p
            torch.cuda.empty_cache()

    if rows:
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

    graph = graph_vs_eager(device, args.iters) if args.decode else None
    if graph is not None:
        print(
            f"\nbatch 32 context 2048, per call: eager {graph['eager_ms_per_call'] * 1e3:.1f} us, "
            f"CUDA graph replay {graph['graph_ms_per_call'] * 1e3:.1f} us; host time per eager "
            f"call {graph['host_us_per_call']:.1f} us ({graph['host_us_per_call_two_splits']:.1f} "
            "us forced to two splits: a merge launch and scratch buffers more)"
        )

    prefill_rows = prefill_section(device, args.iters, flush) if args.prefill else None
    sweep_rows = (
        sweep(device, max(5, args.iters // 2), flush, args.sweep_cases, args.head_dim)
        if args.sweep
        else None
    )
    prefill_sweep_rows = (
        prefill_sweep(device, max(5, args.iters // 2), flush) if args.prefill_sweep else None
    )
    if args.json:
        report = {
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "copy_bandwidth_bytes_per_s": copy_bw,
            "rows": [asdict(r) for r in rows],
            "graph_vs_eager": graph,
            "sweep": sweep_rows,
            "prefill": None if prefill_rows is None else [asdict(r) for r in prefill_rows],
            "prefill_sweep": prefill_sweep_rows,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
