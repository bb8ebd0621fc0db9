"""The engine's tokens against transformers' ``generate``, in one process on the CPU.

The scheduler core, the packer and the worker's step runner run in the engine's own call
order (see ``tests/harness.py``), with many requests of mixed lengths, chunked prefill, a
small token budget and few sequences per step, so that every step mixes prefill chunks with
decodes and carries tokens over.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch._dynamo.utils import counters

from cbpipe.models import EMBEDDED_MODEL_DIR, resolve_model
from cbpipe.protocol.messages import SamplingMode, Step
from cbpipe.protocol.sampling import SamplingParams
from cbpipe.worker.attention import PagedStep
from cbpipe.worker.cuda_graphs import MAX_GRAPH_CHUNKS, Replayable
from tests.harness import InProcessEngine, reference_greedy

QWEN = "random:qwen2-tiny"
EMBEDDED = "default"

needs_embedded = pytest.mark.skipif(
    not (EMBEDDED_MODEL_DIR / "config.json").exists(), reason="embedded model not built"
)


def _prompts(rng: random.Random, vocab: int, count: int, longest: int) -> list[list[int]]:
    lengths = [1, 2, longest] + [rng.randint(1, longest) for _ in range(count - 3)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _check_against_reference(
    engine: InProcessEngine,
    name: str,
    prompts: list[list[int]],
    params: list[SamplingParams],
    eos: list[int] | None,
    mode: str = "async",
) -> None:
    outputs = engine.generate(prompts, params, mode=mode, rng=random.Random(7))
    for prompt, sp, output in zip(prompts, params, outputs, strict=True):
        expected = reference_greedy(name, prompt, sp.max_new_tokens, eos)
        assert output == expected, f"prompt of {len(prompt)} tokens"
    assert engine.blocks.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_random_qwen2_matches_generate(mode: str) -> None:
    rng = random.Random(1)
    prompts = _prompts(rng, 512, count=24, longest=400)
    params = [SamplingParams(max_new_tokens=rng.randint(1, 24)) for _ in prompts]
    engine = InProcessEngine(QWEN, max_batch_tokens=96, max_num_seqs=8)
    _check_against_reference(engine, QWEN, prompts, params, eos=None, mode=mode)


def test_random_qwen2_stops_at_eos() -> None:
    # Random weights rarely emit the configured EOS, so declare as EOS tokens that the
    # reference run shows this model does emit; both sides then stop at them.
    rng = random.Random(2)
    prompts = _prompts(rng, 512, count=12, longest=200)
    free_runs = [reference_greedy(QWEN, p, 12, None) for p in prompts]
    eos = sorted({run[5] for run in free_runs[:4]})
    params = [SamplingParams(max_new_tokens=12) for _ in prompts]
    engine = InProcessEngine(
        QWEN, max_batch_tokens=64, max_num_seqs=6, eos_token_ids=frozenset(eos)
    )
    outputs = engine.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == reference_greedy(QWEN, prompt, 12, eos)
    assert any(len(o) < 12 for o in outputs), "no request stopped at EOS"


@needs_embedded
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_embedded_model_matches_generate(ignore_eos: bool) -> None:
    source = resolve_model(EMBEDDED)
    eos = source.eos_token_ids
    vocab = source.config.vocab_size
    rng = random.Random(3)
    prompts = _prompts(rng, vocab, count=24, longest=500)
    params = [
        SamplingParams(max_new_tokens=rng.randint(1, 48), ignore_eos=ignore_eos) for _ in prompts
    ]
    engine = InProcessEngine(
        EMBEDDED, max_batch_tokens=128, max_num_seqs=10, eos_token_ids=frozenset(eos)
    )
    _check_against_reference(engine, EMBEDDED, prompts, params, eos=None if ignore_eos else eos)


def test_async_sync_and_random_interleaving_agree_on_seeded_sampling() -> None:
    rng = random.Random(4)
    prompts = _prompts(rng, 512, count=16, longest=120)
    params = [
        SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=i)
        for i in range(len(prompts))
    ]
    runs = {
        mode: InProcessEngine(QWEN, max_batch_tokens=64, max_num_seqs=6).generate(
            prompts, params, mode=mode, rng=random.Random(5)
        )
        for mode in ("async", "sync", "random")
    }
    assert runs["async"] == runs["sync"] == runs["random"]
    alone = [
        InProcessEngine(QWEN).generate([p], [sp])[0]
        for p, sp in list(zip(prompts, params, strict=True))[:4]
    ]
    assert alone == runs["async"][:4]
    greedy = InProcessEngine(QWEN).generate(prompts[:4], [SamplingParams(20)] * 4)
    assert greedy != runs["async"][:4], "sampling at temperature 0.9 looked greedy"


def test_preemption_under_small_cache_keeps_reference_outputs() -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(20, 70))] for _ in range(10)]
    params = [SamplingParams(max_new_tokens=40) for _ in prompts]
    # 14 blocks of 8 tokens hold 112 tokens: two or three requests at a time at most.
    engine = InProcessEngine(
        QWEN, num_blocks=14, block_size=8, max_num_seqs=8, max_batch_tokens=64, max_model_len=112
    )
    reqs = [engine.add(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.run(mode="async")
    assert sum(r.num_preemptions for r in reqs) > 0, "the cache was never short"
    for req in reqs:
        assert req.output_token_ids == reference_greedy(QWEN, req.prompt_token_ids, 40, None)
    assert engine.blocks.num_free_blocks == engine.num_blocks


def test_random_arrivals_interleaving_and_cancellation() -> None:
    """Many steps, requests arriving at random steps, random async/sync, random cancels."""
    rng = random.Random(6)
    arrivals: dict[int, list[tuple[list[int], SamplingParams]]] = {}
    for _ in range(30):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randint(1, 150))]
        params = SamplingParams(max_new_tokens=rng.randint(1, 30))
        arrivals.setdefault(rng.randint(1, 60), []).append((prompt, params))
    engine = InProcessEngine(
        QWEN, num_blocks=40, block_size=8, max_num_seqs=5, max_batch_tokens=48, max_model_len=200
    )
    reqs = engine.run(mode="random", rng=rng, arrivals=arrivals, cancel_probability=0.03)
    assert len(reqs) == 30
    finished = [r for r in reqs if r.status.name != "FINISHED_CANCELLED"]
    assert len(finished) < 30, "nothing was cancelled"
    for req in finished:
        expected = reference_greedy(QWEN, req.prompt_token_ids, req.params.max_new_tokens, None)
        assert req.output_token_ids == expected
    assert engine.blocks.num_free_blocks == engine.num_blocks


@needs_embedded
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_decode_graph_bodies_with_the_triton_kernel_match_generate(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The padded decode body that CUDA graphs capture, and the Triton decode kernel, on the
    CPU: the body runs uncaptured at its bucket's fixed size (rows past ``num_seqs`` are
    padding) and the kernel under Triton's interpreter. Steps flip between async and sync,
    so carry-over into a replayed body is exercised too. Compiled: the forward goes through
    ``torch.compile`` (inductor's CPU code here), with the attention op left opaque, and so
    do the eager steps of prefill chunks: through the same compiled graph of the layer."""
    source = resolve_model(EMBEDDED)
    rng = random.Random(5)
    prompts = _prompts(rng, source.config.vocab_size, count=7, longest=60)
    params = [SamplingParams(max_new_tokens=rng.randint(6, 16), ignore_eos=True) for _ in prompts]
    engine = InProcessEngine(
        EMBEDDED,
        max_batch_tokens=64,
        max_num_seqs=6,
        attention_backend="triton",
        compile_decode=compiled,
    )
    graphs = engine.runner.graphs
    # Compiled: no bucket of 1, whose size dynamo would specialise (a second compile).
    assert graphs.batch_sizes == ([2, 4, 6] if compiled else [1, 2, 4, 6])
    if compiled:
        # What the GPU's captures run, every body once: none may compile again after the
        # first run of each variant (each recompile is seconds to minutes of start-up).
        compiled_before = counters["stats"]["unique_graphs"]
        for graph in graphs:
            graph.replay()
        assert counters["stats"]["unique_graphs"] == compiled_before
    # The prefill rows take the torch path here: mixed steps run eagerly.
    assert len(engine.runner.mixed_graphs) == 0
    find, found = engine.runner._find_graph, []

    def counting_find(step: Step, facts: object) -> Replayable | None:
        found.append(find(step, facts))  # type: ignore[arg-type]
        return found[-1]

    engine.runner._find_graph = counting_find  # type: ignore[method-assign]
    # Eager steps attend through the step itself, or through the compiled layers' op.
    attend, attend_cache, calls = PagedStep.attend, PagedStep.attend_cache, Counter[str]()

    def counting_attend(self: PagedStep, *args: object) -> torch.Tensor:
        calls["direct"] += 1
        return attend(self, *args)  # type: ignore[arg-type]

    def counting_attend_cache(self: PagedStep, *args: object) -> torch.Tensor:
        calls["in all"] += 1
        return attend_cache(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(PagedStep, "attend", counting_attend)
    monkeypatch.setattr(PagedStep, "attend_cache", counting_attend_cache)
    _check_against_reference(engine, EMBEDDED, prompts, params, eos=None, mode="random")
    assert sum(r is not None for r in found) >= 10, "too few decode steps replayed"
    assert sum(r is None for r in found) >= 3, "too few eager steps"
    if compiled:  # every eager step (prefill chunks, 2 to 64 rows) ran the compiled layers
        assert calls["direct"] == 0 and calls["in all"] > 0, calls
        assert counters["stats"]["unique_graphs"] == compiled_before
    else:
        assert calls["direct"] == calls["in all"] > 0, calls


@needs_embedded
def test_the_sampling_half_of_every_decode_graph_runs_in_inference_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compile-ahead processes trace and save the samplers under inference mode; a
    sampling half run outside it fails the saved traces' guards, and the worker compiles
    every sampler again (seconds of each start-up, as an H200 call showed)."""
    engine = InProcessEngine(
        EMBEDDED, max_batch_tokens=64, max_num_seqs=4, attention_backend="triton"
    )
    sampling, modes = engine.runner.sampling, []
    sample_decode_rows = sampling.sample_decode_rows

    def recording(*args: object, **kwargs: object) -> None:
        modes.append(torch.is_inference_mode_enabled())
        sample_decode_rows(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sampling, "sample_decode_rows", recording)
    for graph in engine.runner.graphs:
        graph.replay()
    assert len(modes) == len(engine.runner.graphs) > 0
    assert all(modes), modes


@needs_embedded
def test_triton_prefill_and_decode_kernels_match_generate() -> None:
    """Both Triton kernels in the engine (under the interpreter on the CPU): prompts longer
    than the token budget, so their chunks attend to earlier chunks in the cache, mixed with
    decode rows in the same steps, in async, sync and a random mix."""
    source = resolve_model(EMBEDDED)
    rng = random.Random(9)
    prompts = _prompts(rng, source.config.vocab_size, count=6, longest=90)
    params = [SamplingParams(max_new_tokens=rng.randint(3, 10), ignore_eos=True) for _ in prompts]
    engine = InProcessEngine(
        EMBEDDED,
        max_batch_tokens=40,
        max_num_seqs=4,
        attention_backend="triton",
        prefill_backend="triton",
    )
    assert engine.runner.prefill_kernel is not None
    _check_against_reference(engine, EMBEDDED, prompts, params, eos=None, mode="random")


@needs_embedded
@pytest.mark.parametrize(
    ("compiled", "splits"), [(False, 1), (True, 1), (False, 2)], ids=["eager", "compiled", "split"]
)
def test_mixed_graph_bodies_match_generate(
    compiled: bool, splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The padded mixed-step body that CUDA graphs capture (``MixedGraphs``), on the CPU:
    decodes beside prefill chunks, the make-up read from the slot's tensors, at its bucket's
    fixed rows (rows and sequences past the step's are padding), through both kernels under
    Triton's interpreter. Prompts arrive while others decode, some longer than the budget
    (chunks that attend earlier chunks), and one step brings more chunks than a graph takes
    (an eager step). Every replayed step, and the whole run, must match ``generate``.
    ``splits``: the decode keys' splits of a step of fewer decodes than that (one SM here:
    the worker never splits them on the CPU), so those steps replay the split graphs."""
    source = resolve_model(EMBEDDED)
    rng = random.Random(11)
    vocab = source.config.vocab_size
    first = _prompts(rng, vocab, count=3, longest=20)
    # Ten prompts at once: ten chunks, more than a graph's MAX_GRAPH_CHUNKS.
    burst = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 4))] for _ in range(10)]
    later = _prompts(rng, vocab, count=6, longest=90)
    params = {
        id(p): SamplingParams(max_new_tokens=rng.randint(6, 16), ignore_eos=True)
        for p in first + burst + later
    }
    engine = InProcessEngine(
        EMBEDDED,
        max_batch_tokens=48,
        max_num_seqs=16,
        attention_backend="triton",
        prefill_backend="triton",
        compile_decode=compiled,
    )
    mixed = engine.runner.mixed_graphs
    assert mixed.token_sizes == [32, 48]
    if splits > 1:
        monkeypatch.setattr(engine.runner, "_decode_splits", lambda n: splits if n < splits else 1)
    lookups = engine.record_mixed_graph_lookups()
    arrivals = {1: [(p, params[id(p)]) for p in first], 4: [(p, params[id(p)]) for p in burst]}
    arrivals[7] = [(p, params[id(p)]) for p in later]
    finished = engine.run(mode="random", rng=random.Random(3), arrivals=arrivals)
    assert len(finished) == len(params)
    for req in finished:
        expected = reference_greedy(EMBEDDED, req.prompt_token_ids, req.params.max_new_tokens, None)
        assert req.output_token_ids == expected, f"prompt of {len(req.prompt_token_ids)} tokens"
    assert engine.blocks.num_free_blocks == engine.num_blocks
    found = [(lookup.num_chunks, lookup.graph) for lookup in lookups]
    shapes = Counter(lookup.split for lookup in lookups if lookup.graph is not None)
    split_decodes = {
        lookup.step.num_single_token_seqs
        for lookup in lookups
        if lookup.split and lookup.graph is not None
    }
    replayed = [chunks for chunks, graph in found if graph is not None]
    assert len(replayed) >= 5, found
    assert any(chunks > 1 for chunks in replayed), "no graph replayed several chunks"
    assert shapes[True] > 0 if splits > 1 else shapes[True] == 0, shapes
    if splits > 1:  # the split graphs' decode kernel covers only the rows a split step decodes
        assert splits - 1 in split_decodes, split_decodes
    assert any(chunks > MAX_GRAPH_CHUNKS for chunks, graph in found if graph is None), [
        (chunks, graph is not None) for chunks, graph in found
    ]


def _full_sampling_params(index: int) -> SamplingParams:
    """FULL-mode parameters of every kind, in turn: a chat model's generation_config (top-p
    at temperature 0.6), top-k, greedy with presence and frequency penalties, min_p, greedy
    with a logit bias and alternatives; most with a repetition penalty, which counts the prompt's
    tokens (a mixed step's every chunk row) and so tells whether the step counted them."""
    kinds = [
        {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.5},
        {"temperature": 1.0, "top_k": 20, "repetition_penalty": 2.0},
        {"presence_penalty": 0.5, "frequency_penalty": 0.4, "repetition_penalty": 2.0},
        {"temperature": 0.8, "min_p": 0.05},
        {"logit_bias": ((7, 2.0), (11, -3.0)), "logprobs": 3, "repetition_penalty": 2.0},
    ]
    return SamplingParams(
        max_new_tokens=10, seed=index, ignore_eos=True, **kinds[index % len(kinds)]
    )


@needs_embedded
@pytest.mark.parametrize("sampling", ["temperature", "full"])
def test_mixed_graphs_draw_seeded_samples_as_eager_steps_do(sampling: str) -> None:
    """The mixed graphs draw, for seeded requests, the tokens an eager mixed step draws:
    turning the graphs on (the default on CUDA) must not change a seeded reply. With
    temperature alone the graphs sample (``RANDOM``); with the full sampler's parameters the
    graph runs the forward and the full sampler runs eagerly on its logits
    (``LOGITS_HANDOFF``). Prompts arrive while others decode, so most steps are mixed."""
    vocab = resolve_model(EMBEDDED).config.vocab_size
    rng = random.Random(12)
    prompts = _prompts(rng, vocab, count=9, longest=40)
    if sampling == "full":  # a pattern the model would go on with, unless its penalties count it
        prompts = [(p[:5] * 8)[: max(len(p), 15)] for p in prompts]
    params = [
        SamplingParams(max_new_tokens=10, temperature=1.0, seed=i, ignore_eos=True)
        if sampling == "temperature"
        else _full_sampling_params(i)
        for i in range(len(prompts))
    ]
    requests = list(zip(prompts, params, strict=True))

    mode = SamplingMode.RANDOM if sampling == "temperature" else SamplingMode.FULL

    def served(mixed_graph_tokens: int) -> tuple[list[list[int]], int]:
        """Every request's tokens, and how many steps of ``mode`` replayed a mixed graph."""
        engine = InProcessEngine(
            EMBEDDED,
            max_batch_tokens=48,
            max_num_seqs=8,
            attention_backend="triton",
            prefill_backend="triton",
            mixed_graph_tokens=mixed_graph_tokens,
        )
        lookups = engine.record_mixed_graph_lookups()
        arrivals = {1: requests[:3], 3: requests[3:6], 6: requests[6:]}
        finished = engine.run(mode="random", rng=random.Random(3), arrivals=arrivals)
        replays = sum(x.graph is not None and x.step.sampling is mode for x in lookups)
        return [req.output_token_ids for req in finished], replays

    (eager, eager_replays), (graphs, replays) = served(0), served(48)
    assert eager_replays == 0 and replays >= 3, (eager_replays, replays)
    assert graphs == eager
    greedy = [reference_greedy(EMBEDDED, p, 10, None) for p in prompts[:3]]
    assert eager[:3] != greedy, "sampling looked greedy"


@needs_embedded
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_warm_up_touches_only_the_padding_block(backend: str) -> None:
    """The start-up warm-up (run on CUDA before serving) writes keys and values to the
    cache's padding block only, and the engine then still matches ``generate``."""
    import torch

    engine = InProcessEngine(
        EMBEDDED,
        max_batch_tokens=24,
        max_num_seqs=3,
        attention_backend=backend,
        prefill_backend=backend,
    )
    cache = engine.runner.kv_cache
    for tensors in (cache.keys, cache.values):
        for layer in tensors:
            layer.normal_()  # as if earlier requests had filled the cache
    before = [t.clone() for t in (*cache.keys, *cache.values)]
    engine.runner.warm_up()
    padding = slice(cache.padding_slot, cache.padding_slot + cache.block_size)
    for old, new in zip(before, (*cache.keys, *cache.values), strict=True):
        assert torch.equal(old[: padding.start], new[: padding.start])
        assert not torch.equal(old[padding], new[padding])  # it did write there
    source = resolve_model(EMBEDDED)
    rng = random.Random(4)
    prompts = _prompts(rng, source.config.vocab_size, count=4, longest=50)
    params = [SamplingParams(max_new_tokens=rng.randint(2, 8), ignore_eos=True) for _ in prompts]
    _check_against_reference(engine, EMBEDDED, prompts, params, eos=None, mode="random")
