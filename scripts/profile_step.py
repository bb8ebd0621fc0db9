"""Time the worker's step alone, in one process: where does a decode step's time go?

    python scripts/profile_step.py --model random:llama-1b --batch 256 --context 256

Packs one decode step of ``--batch`` sequences with ``--context`` tokens each (their KV
already "computed": the cache holds zeros, which costs the same), runs it repeatedly through
the real ``StepRunner``, and prints the wall time per step, the device time per step (CUDA
events) and the top operators from ``torch.profiler``.

By default each sequence's KV blocks lie together in a cache just large enough.
``--engine-block-layout`` lays them out as a server's batch does when its requests start
together and decode in lockstep: each sequence's prompt blocks (``--prompt-len``) together,
then one block per sequence in turn, in a cache sized as the worker sizes it (most of the
free memory). On an H200 the two layouts gave the same 8B step (11.53 and 11.54 ms on the
device, docs/PERFORMANCE.md, session 5).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from cbpipe.config import CacheConfig
from cbpipe.models import resolve_model
from cbpipe.protocol.sampling import SamplingParams
from cbpipe.protocol.slots import SlotLayout, SlotLimits
from cbpipe.roofline import copy_bandwidth, decode_bytes
from cbpipe.scheduler.block_manager import BlockManager
from cbpipe.scheduler.core import Scheduler
from cbpipe.scheduler.packer import BatchPacker
from cbpipe.scheduler.request import Request
from cbpipe.worker import attention
from cbpipe.worker.model_loader import (
    allocate_kv_cache,
    load_paged_model,
    num_kv_blocks,
    resolve_device,
    resolve_dtype,
)
from cbpipe.worker.runner import StepRunner


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
        "--prefill-len",
        type=int,
        default=0,
        help="add --prefill-seqs sequences whose first chunk of this many prompt tokens joins "
        "the step (a mixed step, run eagerly)",
    )
    parser.add_argument("--prefill-seqs", type=int, default=1)
    parser.add_argument(
        "--engine-block-layout",
        action="store_true",
        help="KV blocks laid out as a server's lockstep batch has them, in a worker-sized cache",
    )
    parser.add_argument(
        "--prompt-len", type=int, default=256, help="prompt tokens, for --engine-block-layout"
    )
    parser.add_argument(
        "--grow",
        action="store_true",
        help="lengthen the attended key range by one at every step, as real decoding does",
    )
    args = parser.parse_args()

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
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
    prefill_kernel = attention.load_prefill_kernel(args.prefill_attention_backend, device)
    runner = StepRunner(model, paged, kv, layout, segment, device, decode_kernel=kernel,
                        prefill_kernel=prefill_kernel,
                        graph_batch_sizes=[args.batch] if graphs else (),
                        compile_decode=args.compile_decode and graphs)  # fmt: skip
    print(f"runner ready in {time.perf_counter() - started:.1f} s (graphs: {len(runner.graphs)})")

    scheduler = Scheduler(BlockManager(num_blocks, bs), max_num_seqs=num_seqs,
                          max_batch_tokens=num_tokens)  # fmt: skip
    decoding = []
    for i in range(args.batch):
        req = Request(i, [1] * args.context, SamplingParams(1), 0, args.context + 1, frozenset())
        req.num_computed_tokens = args.context - 1  # only the last prompt token is left
        if args.engine_block_layout:
            scheduler.blocks.grow(req.block_ids, min(args.prompt_len, blocks_per_seq * bs))
        else:
            scheduler.blocks.grow(req.block_ids, blocks_per_seq * bs)
        decoding.append(req)
    for num_tokens in range(args.prompt_len + bs, blocks_per_seq * bs + 1, bs):
        for req in decoding if args.engine_block_layout else ():
            scheduler.blocks.grow(req.block_ids, num_tokens)  # one block each, in turn
    for req in decoding:
        scheduler.add_request(req)
    for i in range(num_prefills):
        prompt = [2] * args.prefill_len
        scheduler.add_request(
            Request(args.batch + i, prompt, SamplingParams(1), 0, args.prefill_len + 1, frozenset())
        )
    plan = scheduler.schedule()
    step = BatchPacker(segment, layout, bs).pack(plan, 0, None)
    print(f"{args.model} {dtype} on {device}: step of {step.num_seqs} seqs "
          f"({step.num_single_token_seqs} decodes), {step.num_tokens} tokens, "
          f"context {step.max_context_len}")  # fmt: skip

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

    run(3)
    wall, dev = run(args.steps)
    print(f"per step: {wall:.2f} ms wall, {dev:.2f} ms on the device's compute stream")
    if device.type == "cuda" and not num_prefills:
        windows = [layer.variant.sliding_window for layer in paged.layers]
        sizes = decode_bytes(model.config, dtype, windows)
        step_bytes = sizes.step_bytes_for([args.context] * step.num_seqs)
        floor_ms = step_bytes / copy_bandwidth(device) * 1e3
        print(
            f"bandwidth floor {floor_ms:.2f} ms ({sizes.weight_bytes / 1e9:.2f} GB of weights, "
            f"{(step_bytes - sizes.weight_bytes) / 1e9:.2f} GB of KV"
            f"{', windows counted' if sizes.windowed else ''}): "
            f"the step takes {dev / floor_ms:.2f}x the floor"
            f" ({'graph' if runner.graphs.find(step) else 'eager'}, decode kernel "
            f"{'triton' if kernel else 'torch'}, projections "
            f"{'fused' if args.fuse_projections else 'separate'}"
            f"{', compiled' if args.compile_decode else ''})"
        )
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run(5)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25))


if __name__ == "__main__":
    main()
