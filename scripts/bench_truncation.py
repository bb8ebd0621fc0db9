"""Top-k/top-p truncation on the GPU: the Triton kernel against the stable sort it replaced.

    python scripts/bench_truncation.py [--rows 1,32,64,256] [--vocab 128256] [--iters 50]
                                       [--launch BLOCKxWARPS,...] [--no-sampler] [--kernels]
                                       [--json PATH]

Two kinds of rows, both bf16-rounded logits upcast to float32 as a model's are:

* ``peaked``: N(0, 3), the softmax concentrated on a few hundred tokens, as a trained model's
  next-token distribution often is;
* ``flat``: N(0, 0.5), as a random-weight preset's: top-p 0.9 keeps most of the vocabulary and
  the kernel's search takes its most steps.

Each at top-p 0.9 alone and at top-k 50 with top-p 0.9. Times are the median over ``--iters``
replays of a CUDA graph holding one call (so launch overhead is not counted), by CUDA events.
Then, unless ``--no-sampler``, the compiled samplers as the worker's graphs run them, on
peaked rows: the full sampler (``sample_full`` at Llama 3's generation config, temperature
0.6 and top-p 0.9) through its kernels, the same with top-p by the sort, and its plain-torch
reference compiled by inductor; the temperature-only sampler (``sample``) through the same
kernels and its plain-torch reference. Each truncation case also
reports how many rows keep the same tokens both ways; ``--kernels`` lists the compiled
sampler's kernels at each row count (one replay, from the profiler), with the kernel.
First, ``--launch 2048x8,8192x16`` times the kernel at each of those pass widths and warp
counts (the module's ``_BLOCK`` and ``_NUM_WARPS``) in turn, with rows at top-p 1 beside
(``keep-all``: no search, the first pass and the write alone), and the rest runs at the last
of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Callable

import torch

from cbpipe.roofline import graph_kernels, graph_replay_ms
from cbpipe.worker.kernels import truncation
from cbpipe.worker.sampler import (
    FullSamplingInputs,
    SamplingInputs,
    sample,
    sample_full,
    sample_full_reference,
    sample_reference,
    top_k_top_p_cut_reference,
    top_k_top_p_reference,
)


def captured(fn: Callable[..., object], *args: object) -> torch.cuda.CUDAGraph:
    """A CUDA graph holding one call of ``fn(*args)``, warmed (and compiled) outside it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*args)  # compiles and warms outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    return graph


def graph_time(iters: int, fn: Callable[..., object], *args: object) -> float:
    """Median milliseconds of one replay of a graph holding ``fn(*args)``."""
    return statistics.median(graph_replay_ms(captured(fn, *args), iters))


def make_logits(kind: str, rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = 3.0 if kind == "peaked" else 0.5
    x = torch.randn(rows, vocab, device="cuda", generator=gen) * scale
    return x.bfloat16().float()


def llama3_sampling(rows: int) -> FullSamplingInputs:
    """Every row at Llama 3's generation config: temperature 0.6, top-p 0.9."""

    def column(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device="cuda")

    return FullSamplingInputs(
        temperature=column(0.6), top_p=column(0.9), top_k=column(0, torch.int32),
        min_p=column(0.0), presence_penalty=column(0.0), frequency_penalty=column(0.0),
        repetition_penalty=column(1.0), seed=torch.arange(rows, device="cuda"),
        output_index=column(3, torch.int32), rows=torch.arange(rows, device="cuda"),
        truncation=True,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32,64,256")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--launch", default="", help="BLOCKxWARPS,...: kernel settings to sweep")
    parser.add_argument("--no-sampler", action="store_true")
    parser.add_argument("--kernels", action="store_true", help="the sampler's kernels, profiled")
    parser.add_argument("--json")
    args = parser.parse_args()
    results = []
    launches = [tuple(map(int, item.split("x"))) for item in args.launch.split(",") if item]
    for block, warps in launches:
        truncation._BLOCK, truncation._NUM_WARPS = block, warps
        for rows in (int(r) for r in args.rows.split(",")):
            # keep-all: top-p 1, so no search: the first pass and the write alone.
            for kind, p in (("peaked", 0.9), ("flat", 0.9), ("keep-all", 1.0)):
                logits = make_logits("flat" if kind == "flat" else "peaked", rows, args.vocab)
                top_p = torch.full((rows,), p, device="cuda")
                top_k = torch.zeros(rows, dtype=torch.int32, device="cuda")
                ms = graph_time(args.iters, truncation.top_k_top_p_triton, logits, top_k, top_p)
                results.append(dict(kind=kind, rows=rows, block=block, warps=warps, kernel_ms=ms))
                print(f"launch {block}x{warps}: {kind:8} top-p {p} rows {rows:>4}: {ms:.3f} ms",
                      flush=True)  # fmt: skip
    if launches:
        truncation._BLOCK, truncation._NUM_WARPS = launches[-1]
    print(f"{'kind':7} {'top-k':>5} {'rows':>5} {'sort ms':>8} {'kernel ms':>9} {'x':>6} "
          f"{'same as sort':>12} {'kept p50':>8}")  # fmt: skip
    for rows in (int(r) for r in args.rows.split(",")):
        for kind in ("peaked", "flat"):
            logits = make_logits(kind, rows, args.vocab)
            top_p = torch.full((rows,), 0.9, device="cuda")
            for k in (0, 50):
                top_k = torch.full((rows,), k, dtype=torch.int32, device="cuda")
                call = (logits, top_k, top_p)
                sort_ms = graph_time(args.iters, top_k_top_p_reference, *call)
                kernel_ms = graph_time(args.iters, truncation.top_k_top_p_triton, *call)
                want = top_k_top_p_reference(*call) > float("-inf")
                got = truncation.top_k_top_p_triton(*call) > float("-inf")
                same = int((want == got).all(-1).sum())
                kept = int(got.sum(-1).float().median())
                results.append(
                    dict(kind=kind, top_k=k, rows=rows, sort_ms=sort_ms, kernel_ms=kernel_ms,
                         same_rows=same, kept_p50=kept)
                )  # fmt: skip
                print(
                    f"{kind:7} {k:>5} {rows:>5} {sort_ms:8.3f} {kernel_ms:9.3f} "
                    f"{sort_ms / kernel_ms:6.1f} {same:>8}/{rows:<3} {kept:>8}",
                    flush=True,
                )

    if not args.no_sampler:
        from cbpipe.worker.compiling import compile_decode_fn

        print(f"\n{'compiled samplers':18} {'rows':>5} {'full ms':>8} {'w/ sort':>8} "
              f"{'torch':>8} {'temp. ms':>8} {'torch':>8}")  # fmt: skip
        full = compile_decode_fn(sample_full)
        full_torch = compile_decode_fn(sample_full_reference)
        plain = compile_decode_fn(sample)
        plain_torch = compile_decode_fn(sample_reference)
        cut_kernel = truncation.top_k_top_p_cut_triton
        for rows in (int(r) for r in args.rows.split(",")):
            logits = make_logits("peaked", rows, args.vocab).bfloat16()
            state = torch.zeros(rows + 1, args.vocab, device="cuda")
            counts = torch.zeros(rows + 1, args.vocab, dtype=torch.int32, device="cuda")
            seen = counts > 0

            inputs = llama3_sampling(rows)
            call = (logits, state, counts, seen, inputs)
            plain_call = (logits, SamplingInputs(
                inputs.temperature, inputs.seed, inputs.output_index, all_greedy=False
            ))  # fmt: skip
            timings = {
                "full_ms": graph_time(args.iters, full, *call),
                "full_torch_ms": graph_time(args.iters, full_torch, *call),
                "temperature_ms": graph_time(args.iters, plain, *plain_call),
                "temperature_torch_ms": graph_time(args.iters, plain_torch, *plain_call),
            }
            truncation.top_k_top_p_cut_triton = top_k_top_p_cut_reference  # the op's call
            try:
                timings["full_sort_ms"] = graph_time(args.iters, full, *call)
            finally:
                truncation.top_k_top_p_cut_triton = cut_kernel
            results.append(dict(kind="samplers", rows=rows, **timings))
            print(f"{'':18} {rows:>5} {timings['full_ms']:8.3f} {timings['full_sort_ms']:8.3f} "
                  f"{timings['full_torch_ms']:8.3f} {timings['temperature_ms']:8.3f} "
                  f"{timings['temperature_torch_ms']:8.3f}", flush=True)  # fmt: skip
            if args.kernels:
                kernels = graph_kernels(captured(full, *call))
                results.append(dict(kind="sample_full_kernels", rows=rows,
                                    kernels=[dataclasses.asdict(k) for k in kernels]))  # fmt: skip
                for k in kernels:
                    print(f"{'':6} {k.us:7.1f} us  gap {k.gap_us:5.1f}  {k.name[:90]}")
                print(f"{'':6} {sum(k.us for k in kernels):7.1f} us in {len(kernels)} kernels, "
                      f"gaps {sum(k.gap_us for k in kernels):.1f} us", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
