"""The worker's step on CUDA: no host synchronisation, and carry-over across many steps."""

from __future__ import annotations

import random

import pytest
import torch

from cbpipe.models import resolve_model
from cbpipe.protocol.messages import SamplingMode
from cbpipe.protocol.sampling import SamplingParams
from tests.harness import InProcessEngine, reference_greedy

pytestmark = pytest.mark.gpu

MODEL = "random:qwen2-tiny"
EMBEDDED = "default"


def test_enqueueing_a_step_never_synchronises_the_host() -> None:
    engine = InProcessEngine(MODEL, device=torch.device("cuda"), max_batch_tokens=64)
    try:
        for n in (1, 40, 3, 90):
            engine.add(list(range(5, 5 + n)), SamplingParams(max_new_tokens=4))
        first = engine.scheduler.schedule()  # prefill chunks
        second = engine.scheduler.schedule()  # chunks and decodes that carry tokens over
        steps = [engine.packer.pack(first, 0, None), engine.packer.pack(second, 1, 0)]
        assert steps[1].carry_from_slot == 0
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = [engine.runner.launch(step) for step in steps]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for item in launched:
            item.wait()
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["decode", "mixed", "mixed-full"])
def test_replaying_a_graph_never_synchronises_the_host(kind: str) -> None:
    """A decode step (it carries every token over) and a mixed one (those decodes beside a
    new prompt's chunk), each replayed from its graph; "mixed-full": the new prompt samples
    with top-p and a repetition penalty, so the graph runs the forward and hands its logits
    to the eager full sampler."""
    engine = InProcessEngine(MODEL, device=torch.device("cuda"), max_num_seqs=8)
    try:
        for n in (3, 17, 5):
            engine.add(list(range(5, 5 + n)), SamplingParams(max_new_tokens=8))
        prefill = engine.packer.pack(engine.scheduler.schedule(), 0, None)
        if kind != "decode":
            full = SamplingParams(
                max_new_tokens=8, temperature=0.7, top_p=0.9, repetition_penalty=1.3, seed=1
            )
            plain = SamplingParams(max_new_tokens=8)
            engine.add(list(range(7, 47)), full if kind == "mixed-full" else plain)
        step = engine.packer.pack(engine.scheduler.schedule(), 1, 0)
        assert (step.num_single_token_seqs, step.num_seqs) == (3, 3 if kind == "decode" else 4)
        assert (step.sampling is SamplingMode.FULL) == (kind == "mixed-full")
        assert engine.runner.graph_for(step) is not None
        engine.runner.launch(prefill).wait()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = engine.runner.launch(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        launched.wait()
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("backend", "graphs", "prefill", "fuse", "compile_decode"),
    [
        ("auto", True, "auto", True, False),
        ("auto", True, "auto", True, True),
        ("triton", False, "torch", True, False),
        ("torch", False, "torch", False, False),
    ],
    ids=["defaults", "compiled", "triton-eager-torch-prefill", "torch-eager-unfused"],
)
def test_many_overlapping_steps_match_generate_on_cuda(
    backend: str, graphs: bool, prefill: str, fuse: bool, compile_decode: bool
) -> None:
    """Two steps really in flight on three streams, for hundreds of steps, with random
    switches between async and sync: greedy tokens equal transformers' ``generate`` on CUDA
    in float32. The embedded model is trained, so its top logits rarely tie (a random model's
    do, and then CUDA and CPU kernels may legitimately pick different tokens)."""
    source = resolve_model(EMBEDDED)
    rng = random.Random(11)
    prompts = [
        [rng.randrange(3, source.config.vocab_size) for _ in range(rng.randint(1, 200))]
        for _ in range(24)
    ]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 40), ignore_eos=True) for _ in prompts]
    cuda = torch.device("cuda")
    engine = InProcessEngine(
        EMBEDDED,
        max_batch_tokens=64,
        max_num_seqs=8,
        device=cuda,
        attention_backend=backend,
        cuda_graphs=graphs,
        prefill_backend=prefill,
        fuse_projections=fuse,
        compile_decode=compile_decode,
    )
    assert (len(engine.runner.graphs) > 0) == graphs
    # With graphs, the mixed steps (24 prompts over 64-token steps, beside decodes) replay
    # the mixed graphs; counted to check that they did.
    assert (len(engine.runner.mixed_graphs) > 0) == graphs
    lookups = engine.record_mixed_graph_lookups()
    try:
        outputs = engine.generate(prompts, params, mode="random", rng=random.Random(1))
    finally:
        engine.close()
    if graphs:
        replayed = [lookup.graph is not None for lookup in lookups]
        assert sum(replayed) >= 10, replayed
    for prompt, sp, output in zip(prompts, params, outputs, strict=True):
        expected = reference_greedy(EMBEDDED, prompt, sp.max_new_tokens, None, device=cuda)
        assert output == expected, f"prompt of {len(prompt)} tokens"


def _compiled_kernel_variants() -> int:
    """Variants Triton has compiled of our kernels in this process, on every device."""
    from cbpipe.worker.kernels import (
        cache_write,
        full_sample,
        greedy_sample,
        paged_decode,
        paged_prefill,
        state_counts,
        truncation,
    )

    kernels = (
        paged_decode._split_kv_kernel,
        paged_decode._merge_splits_kernel,
        paged_prefill._prefill_kernel,
        cache_write._write_kv_kernel,
        greedy_sample._piece_kernel,
        greedy_sample._merge_kernel,
        full_sample._prepare_kernel,
        full_sample._min_p_kernel,
        full_sample._draw_kernel,
        full_sample._merge_kernel,
        truncation._top_k_top_p_kernel,
        state_counts._count_inputs_kernel,
        state_counts._count_sampled_kernel,
    )
    total = 0
    for kernel in kernels:
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton version keeps no device_caches to count variants in")
        total += sum(len(entry[0]) for entry in caches.values())  # entry[0]: the kernel cache
    return total


@pytest.mark.parametrize(
    ("block_size", "compiled"), [(8, False), (32, True)], ids=["eager", "compiled"]
)
def test_no_kernel_compiles_while_serving_after_warm_up(block_size: int, compiled: bool) -> None:
    """Start-up's warm-up compiles every kernel variant eager steps meet, so none stalls a
    running server (the first H200 runs spent 1.3-1.7 s per new variant mid-run; an 8B
    run's first top-p request 1.7 s, its prefill sampling one row where the full sampler's
    graphs start at eight). The requests are greedy, sampled, and fully processed (top-p,
    min-p, penalties), so eager steps sample any number of rows each way. Compiled, the
    eager steps run the decode graphs' compiled layers, and dynamo compiles nothing after
    the start either."""
    from cbpipe.worker.compiling import dynamo_graphs

    source = resolve_model(EMBEDDED)
    before_start = _compiled_kernel_variants()
    # Block sizes no other test uses: constants of the kernels, so this engine's variants
    # are new here.
    engine = InProcessEngine(
        EMBEDDED,
        block_size=block_size,
        max_batch_tokens=96,
        max_num_seqs=12,
        device=torch.device("cuda"),
        # Eager: eager decode steps too, so every batch size takes the kernels.
        cuda_graphs=compiled,
        compile_decode=compiled,
    )
    try:
        after_start = _compiled_kernel_variants()
        graphs_after_start = dynamo_graphs()
        assert after_start > before_start
        rng = random.Random(5)
        prompts = [
            [rng.randrange(3, source.config.vocab_size) for _ in range(rng.randint(1, 300))]
            for _ in range(40)
        ]
        kinds = [
            {},
            {"temperature": 0.8, "seed": 3},
            {"temperature": 0.7, "top_p": 0.9},
            {"temperature": 1.0, "min_p": 0.05, "presence_penalty": 0.5},
        ]
        params = [
            SamplingParams(max_new_tokens=rng.randint(1, 30), ignore_eos=True, **kinds[i % 4])
            for i in range(len(prompts))
        ]
        engine.generate(prompts, params, mode="random", rng=random.Random(2))
        assert _compiled_kernel_variants() == after_start
        assert dynamo_graphs() == graphs_after_start
    finally:
        engine.close()
