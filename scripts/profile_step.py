"""Time the worker's step alone, in one process: where does a decode step's time go?

    python scripts/profile_step.py --model random:llama-1b --batch 256 --context 256

Packs one decode step of ``--batch`` sequences with ``--context`` tokens each (their KV
already "computed": the cache holds zeros, which costs the same), runs it repeatedly through
the real ``StepRunner``, and prints the wall time per step, the device time per step (CUDA
events) and the top operators from ``torch.profiler``.

``--sampling greedy,random,full,...`` times the same step once per sampling preset
(``SAMPLING_PRESETS``: greedy, plain temperature, the full sampler with and without top
alternatives, penalties), each from its own graph variant, one line each.

By default each sequence's KV blocks lie together in a cache just large enough.
``--engine-block-layout`` lays them out as a server's batch does when its requests start
together and decode in lockstep: each sequence's prompt blocks (``--prompt-len``) together,
then one block per sequence in turn, in a cache sized as the worker sizes it (most of the
free memory). On an H200 the two layouts gave the same 8B step (11.53 and 11.54 ms on the
device, docs/PERFORMANCE.md, session 5).

``--inductor NAME=VALUE`` (repeatable) sets one of inductor's options for this process's
compiles (``--inductor combo_kernels=True``, ``--inductor triton.max_tiles=1``), to time a
setting before it is proposed for the worker; inductor keys its caches on its options, so a
setting never reuses another's kernels.
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import dataclasses
import functools
import io
import pstats
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from cbpipe.config import CacheConfig
from cbpipe.models import resolve_model
from cbpipe.protocol.messages import Step
from cbpipe.protocol.sampling import SamplingParams
from cbpipe.protocol.slots import SlotLayout, SlotLimits
from cbpipe.roofline import copy_bandwidth, decode_bytes
from cbpipe.scheduler.block_manager import BlockManager
from cbpipe.scheduler.core import Scheduler
from cbpipe.scheduler.packer import BatchPacker
from cbpipe.scheduler.request import Request, RequestStatus
from cbpipe.worker import attention
from cbpipe.worker import runner as runner_module
from cbpipe.worker.blas import use_blas_library
from cbpipe.worker.compiled_layers import ModuleCompiler, compile_layers
from cbpipe.worker.cuda_graphs import bucket_sizes
from cbpipe.worker.model_loader import (
    allocate_kv_cache,
    load_paged_model,
    num_kv_blocks,
    resolve_device,
    resolve_dtype,
)
from cbpipe.worker.runner import StepRunner

# What each request of the step asks for, per --sampling preset.
SAMPLING_PRESETS = {
    "greedy": SamplingParams(1),
    "random": SamplingParams(1, temperature=0.8),
    # FULL: top-k, top-p and min_p (the sort), without and with the top 20 alternatives.
    "full": SamplingParams(1, temperature=0.8, top_p=0.95, top_k=50, min_p=0.05),
    "full-logprobs": SamplingParams(
        1, temperature=0.8, top_p=0.95, top_k=50, min_p=0.05, logprobs=20
    ),
    # FULL without the sort: the penalties (their state rows), then with alternatives.
    "penalties": SamplingParams(
        1, temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
    ),
    "greedy-logprobs": SamplingParams(1, logprobs=5),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-1b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--attention-backend", choices=("auto", "triton", "torch"), default="auto")
    parser.add_argument(
        "--prefill-attention-backend", choices=("auto", "torch", "triton"), default="auto"
    )
    parser.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compile-decode", action="store_true")
    parser.add_argument(
        "--compile-siblings", action=argparse.BooleanOptionalAction, default=True,
        help="with --compile-decode, compile the layers' siblings too (the final norm, the "
        "rotary tables), as the worker does; --no-compile-siblings: the layers alone",
    )  # fmt: skip
    parser.add_argument(
        "--compile-whole", action="store_true",
        help="with --compile-decode, compile the whole forward as one graph instead of a graph "
        "a layer: what fusing across the layers' edges would gain, at a longer compile",
    )  # fmt: skip
    parser.add_argument(
        "--blas-library", choices=("auto", "cublaslt", "cublas"), default="auto",
        help="as the launcher's flag: the BLAS library of the products on CUDA",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-len",
        type=int,
        default=0,
        help="add --prefill-seqs sequences whose first chunk of this many prompt tokens joins "
        "the step (a mixed step: no graph; through the compiled layers with --compile-decode)",
    )
    parser.add_argument("--prefill-seqs", type=int, default=1)
    parser.add_argument(
        "--mixed-graph-tokens", type=int, default=0,
        help="as the worker's flag: replay mixed steps of up to this many tokens from CUDA "
        "graphs (default 0 here: eager, as --prefill-len steps were timed before)",
    )  # fmt: skip
    parser.add_argument(
        "--engine-block-layout",
        action="store_true",
        help="KV blocks laid out as a server's lockstep batch has them, in a worker-sized cache",
    )
    parser.add_argument(
        "--prompt-len", type=int, default=256, help="prompt tokens, for --engine-block-layout"
    )
    parser.add_argument(
        "--sampling",
        default="greedy",
        help=f"comma list of sampling presets to time, of {', '.join(SAMPLING_PRESETS)}",
    )
    parser.add_argument(
        "--all-buckets",
        action="store_true",
        help="capture every bucket up to --batch, as the worker does (start-up's capture cost)",
    )
    parser.add_argument(
        "--full-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="capture the full sampler's graph variants (--no-full-graphs: FULL runs eagerly)",
    )
    parser.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="print torch.profiler's top operators (default: with one sampling preset)",
    )
    parser.add_argument(
        "--profile-first",
        action="store_true",
        help="profile the make-up's first launch alone, by the operators' own CPU time",
    )
    parser.add_argument(
        "--profile-rows", type=int, default=25,
        help="rows of the profile's table (enough to reach the kernels that run once a step, "
        "outside the layers)",
    )  # fmt: skip
    parser.add_argument(
        "--cprofile", type=int, default=0, metavar="STEPS",
        help="run STEPS more launches under cProfile and print the Python functions with the "
        "most host time (their own, then with what they call): where a host-bound step goes",
    )  # fmt: skip
    parser.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set an option of torch._inductor.config (repeatable)",
    )
    parser.add_argument(
        "--grow",
        action="store_true",
        help="lengthen the attended key range by one at every step, as real decoding does",
    )
    args = parser.parse_args()
    for option in args.inductor:
        _set_inductor_option(parser, option)

    if not args.compile_siblings:  # the runner's own reference, for this process only
        runner_module.compile_layers = functools.partial(compile_layers, siblings=False)
    if args.compile_whole:
        runner_module.compile_layers = _compile_whole
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    blas = use_blas_library(args.blas_library, device)
    model, paged = load_paged_model(resolve_model(args.model), device, dtype,
                                    fuse=args.fuse_projections)  # fmt: skip
    bs = args.block_size
    # Room for the keys a --grow run attends to (they are masked, but gathered).
    longest = max(args.context + 2 * args.steps + 16, args.prefill_len)
    blocks_per_seq = -(-longest // bs)
    num_prefills = args.prefill_seqs if args.prefill_len else 0
    num_seqs = args.batch + num_prefills
    num_tokens = args.batch + num_prefills * args.prefill_len
    num_blocks = num_seqs * blocks_per_seq
    if args.engine_block_layout:
        num_blocks = max(
            num_blocks, num_kv_blocks(paged, CacheConfig(block_size=bs), device, dtype)
        )
    kv = allocate_kv_cache(paged, num_blocks, bs, device, dtype)
    layout = SlotLayout.build(SlotLimits(num_tokens, num_seqs, blocks_per_seq))
    segment = memoryview(bytearray(layout.segment_nbytes))
    kernel = attention.load_decode_kernel(args.attention_backend, device)
    graphs = args.cuda_graphs and kernel is not None
    started = time.perf_counter()
    # Free device memory, not torch's reserved pool: start-up may hand cached blocks back.
    free_before = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    prefill_kernel = attention.load_prefill_kernel(args.prefill_attention_backend, device)
    batch_sizes = bucket_sizes(args.batch) if args.all_buckets else [args.batch]
    runner = StepRunner(model, paged, kv, layout, segment, device, decode_kernel=kernel,
                        prefill_kernel=prefill_kernel,
                        graph_batch_sizes=batch_sizes if graphs else (),
                        compile_decode=args.compile_decode and graphs,
                        full_sampling_graphs=args.full_graphs, blas=blas,
                        mixed_graph_tokens=args.mixed_graph_tokens)  # fmt: skip
    grown_gib = 0.0
    if device.type == "cuda":
        grown_gib = (free_before - torch.cuda.mem_get_info(device)[0]) / 2**30
    state_mib = runner.state.nbytes(num_seqs, runner.vocab) / 2**20
    print(f"runner ready in {time.perf_counter() - started:.1f} s (graphs: {len(runner.graphs)}"
          f", full sampler at {runner.graphs.full_batch_sizes}; device memory taken "
          f"{grown_gib:.2f} GiB, of which the sampling state {state_mib:.0f} MiB)")  # fmt: skip

    presets = args.sampling.split(",")
    unknown = [name for name in presets if name not in SAMPLING_PRESETS]
    if unknown:
        parser.error(f"unknown --sampling presets {unknown}; known: {list(SAMPLING_PRESETS)}")
    profile = args.profile if args.profile is not None else len(presets) == 1
    for name in presets:
        step = _pack_step(args, layout, segment, num_blocks, blocks_per_seq, SAMPLING_PRESETS[name])
        _time_step(args, runner, model, kernel, device, dtype, step, name, profile)


def _compile_whole(
    model: torch.nn.Module, compile_module: ModuleCompiler, *, siblings: bool = True
) -> torch.nn.Module:
    """``compile_layers``'s stand-in for ``--compile-whole``: the whole forward one graph."""
    return compile_module(model)


def _set_inductor_option(parser: argparse.ArgumentParser, option: str) -> None:
    """``NAME=VALUE`` onto ``torch._inductor.config``; the value a Python literal or a string."""
    from torch._inductor import config

    name, sep, text = option.partition("=")
    if not sep:
        parser.error(f"--inductor {option!r}: expected NAME=VALUE")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    *parents, leaf = name.split(".")
    try:
        owner = functools.reduce(getattr, parents, config)
        getattr(owner, leaf)  # unknown names fail here, not silently
    except AttributeError:
        parser.error(f"--inductor {option!r}: inductor has no option {name!r}")
    setattr(owner, leaf, value)
    print(f"inductor option {name} = {value!r}")


def _pack_step(
    args: argparse.Namespace,
    layout: SlotLayout,
    segment: memoryview,
    num_blocks: int,
    blocks_per_seq: int,
    params: SamplingParams,
) -> Step:
    """One step of ``--batch`` decodes (and the prefill sequences), packed into slot 0."""
    bs = args.block_size
    num_prefills = args.prefill_seqs if args.prefill_len else 0
    num_seqs = args.batch + num_prefills
    num_tokens = args.batch + num_prefills * args.prefill_len
    scheduler = Scheduler(BlockManager(num_blocks, bs), max_num_seqs=num_seqs,
                          max_batch_tokens=num_tokens)  # fmt: skip
    decoding = []
    for i in range(args.batch):
        req = Request(i, [1] * args.context, params, i, args.context + 1, frozenset())
        req.num_computed_tokens = args.context - 1  # only the last prompt token is left
        if args.engine_block_layout:
            scheduler.blocks.grow(req.block_ids, min(args.prompt_len, blocks_per_seq * bs))
        else:
            scheduler.blocks.grow(req.block_ids, blocks_per_seq * bs)
        decoding.append(req)
    for total in range(args.prompt_len + bs, blocks_per_seq * bs + 1, bs):
        for req in decoding if args.engine_block_layout else ():
            scheduler.blocks.grow(req.block_ids, total)  # one block each, in turn
    for req in decoding:
        _resume_decoding(scheduler, req)
    for i in range(num_prefills):
        prompt = [2] * args.prefill_len
        scheduler.add_request(
            Request(args.batch + i, prompt, params, 0, args.prefill_len + 1, frozenset())
        )
    plan = scheduler.schedule()
    # The decoding requests take their rows in this step, as if admitted in it.
    plan.assigned[:0] = decoding
    plan.admitted[:0] = decoding
    return BatchPacker(segment, layout, bs).pack(plan, 0, None)


def _resume_decoding(scheduler: Scheduler, req: Request) -> None:
    """Run ``req``, whose context already fills its blocks, from the next step on: where
    admission would leave it once its prompt was computed. (Admission itself computes a
    queued prompt from its cached prefix on, which here is none.)"""
    scheduler.requests[req.request_id] = req
    req.status = RequestStatus.RUNNING
    scheduler.running.append(req)
    scheduler.tables.assign(req)


def _time_step(
    args: argparse.Namespace,
    runner: StepRunner,
    model: torch.nn.Module,
    kernel: object,
    device: torch.device,
    dtype: torch.dtype,
    step: Step,
    preset: str,
    profile: bool,
) -> None:
    num_prefills = args.prefill_seqs if args.prefill_len else 0
    print(f"{args.model} {dtype} on {device}: step of {step.num_seqs} seqs "
          f"({step.num_single_token_seqs} decodes), {step.num_tokens} tokens, "
          f"context {step.max_context_len}, sampling {preset} ({step.sampling.value}"
          f"{', top alternatives' if step.top_logprobs else ''})")  # fmt: skip

    grown = 0

    def run(n: int) -> tuple[float, float]:
        nonlocal grown
        start = time.perf_counter()
        device_ms = 0.0
        for _ in range(n):
            grown += args.grow
            this = dataclasses.replace(step, max_context_len=step.max_context_len + grown)
            device_ms += runner.launch(this).wait().device_ms
        return (time.perf_counter() - start) * 1e3 / n, device_ms / n

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # The first launch of a make-up apart: whatever it meets for the first time since the
    # runner's warm-up (a kernel variant, the allocator's growth) shows only there.
    first = torch.profiler.profile(activities=activities) if args.profile_first else None
    with first or nullcontext():
        first_wall, first_dev = run(1)
    print(
        f"first step: {first_wall:.2f} ms wall, {first_dev:.2f} ms on the device's compute stream"
    )
    if first is not None:
        print(
            first.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
        )
    run(2)
    wall, dev = run(args.steps)
    replayed = "a graph" if runner.graph_for(step) is not None else "eagerly"
    print(f"per step: {wall:.2f} ms wall, {dev:.2f} ms on the device's compute stream "
          f"(sampling {preset}, {replayed})")  # fmt: skip
    if device.type == "cuda" and not num_prefills:
        windows = [layer.variant.sliding_window for layer in runner.attention.layers]
        sizes = decode_bytes(model.config, dtype, windows)
        step_bytes = sizes.step_bytes_for([args.context] * step.num_seqs)
        floor_ms = step_bytes / copy_bandwidth(device) * 1e3
        graph = runner.graph_for(step)
        print(
            f"bandwidth floor {floor_ms:.2f} ms ({sizes.weight_bytes / 1e9:.2f} GB of weights, "
            f"{(step_bytes - sizes.weight_bytes) / 1e9:.2f} GB of KV"
            f"{', windows counted' if sizes.windowed else ''}): "
            f"the step takes {dev / floor_ms:.2f}x the floor"
            f" ({'graph' if graph else 'eager'}, decode kernel "
            f"{'triton' if kernel else 'torch'}, projections "
            f"{'fused' if args.fuse_projections else 'separate'}"
            f"{', compiled' if args.compile_decode else ''})"
        )
    if args.cprofile:
        _print_cprofile(lambda: run(args.cprofile), args.cprofile, args.profile_rows)
    if not profile:
        return
    with torch.profiler.profile(activities=activities) as prof:
        run(5)
    if device.type == "cuda":
        # The kernels' own device time against the step's wall: a step whose wall is several
        # times its kernels is bound by its launches, whatever its compute stream's span says.
        cuda = torch.autograd.DeviceType.CUDA
        kernels_ms = (
            sum(
                event.time_range.elapsed_us()
                for event in prof.events()
                if event.device_type == cuda
            )
            / 5e3
        )
        print(f"kernels {kernels_ms:.2f} ms a step (the profiler's device time, 5 steps); "
              f"wall {wall / kernels_ms:.2f}x the kernels")  # fmt: skip
    # Beside --profile-first's table, sorted alike: what the first launch spent over these.
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    if args.profile_first:
        sort = "self_cpu_time_total"
        print("the next 5 launches (totals over the 5):")
    print(prof.key_averages().table(sort_by=sort, row_limit=args.profile_rows))


def _print_cprofile(run: Callable[[], object], steps: int, rows: int) -> None:
    """``run`` under cProfile; the functions' host time a step, by own time then by total."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).strip_dirs().sort_stats(order)
        stats.print_stats(rows)
        print(f"cProfile over {steps} steps, by {order} (seconds for all {steps}):")
        table = text.getvalue()
        print(table[table.find("ncalls") :].rstrip())  # the table, not pstats' preamble


if __name__ == "__main__":
    main()
