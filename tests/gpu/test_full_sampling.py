"""The full sampler on CUDA: no host synchronisation, and graphs (captured, and compiled)
that sample what eager steps sample."""

from __future__ import annotations

import random

import pytest
import torch

from cbpipe.models import resolve_model
from cbpipe.protocol.messages import SamplingMode
from cbpipe.protocol.sampling import SamplingParams
from tests.harness import InProcessEngine, reference_greedy

pytestmark = pytest.mark.gpu

EMBEDDED = "default"
CUDA = torch.device("cuda")


def test_full_steps_never_synchronise_the_host() -> None:
    """A FULL prefill with prompt log-probabilities, bias entries and a reset, then a FULL
    decode-only step from a graph with a reset and bias entries before its replay."""
    engine = InProcessEngine(EMBEDDED, device=CUDA, max_batch_tokens=64, max_num_seqs=8)
    try:
        engine.add(
            list(range(5, 45)),
            SamplingParams(8, repetition_penalty=1.2, logprobs=5, prompt_logprobs=3, top_p=0.9),
        )
        first = engine.packer.pack(engine.scheduler.schedule(), 0, None)
        assert first.sampling is SamplingMode.FULL and first.prompt_logprobs
        engine.add([7], SamplingParams(8, logit_bias=((3, 2.0),), min_tokens=2, logprobs=1))
        second = engine.packer.pack(engine.scheduler.schedule(), 1, 0)  # decode + 1-row prompt
        assert second.num_single_token_seqs == second.num_seqs == 2
        assert second.num_bias_entries > 0
        assert engine.runner.graphs.find(second, truncation=True) is not None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = [engine.runner.launch(first), engine.runner.launch(second)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for item in launched:
            item.wait()
    finally:
        engine.close()


def _requests(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(21)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 120))] for _ in range(16)]
    prompts[2] = prompts[2][:1]
    kinds = [
        lambda i: SamplingParams(24, repetition_penalty=1.3, ignore_eos=True),
        lambda i: SamplingParams(24, presence_penalty=0.6, frequency_penalty=0.4, ignore_eos=True),
        lambda i: SamplingParams(24, logit_bias=((11, 3.0), (12, -50.0)), ignore_eos=True),
        lambda i: SamplingParams(24, temperature=0.9, top_p=0.9, top_k=40, seed=i, logprobs=5),
        lambda i: SamplingParams(24, temperature=1.1, min_p=0.05, seed=i, ignore_eos=True),
        lambda i: SamplingParams(24, temperature=0.8, seed=i, ignore_eos=True),
        lambda i: SamplingParams(24, logprobs=20, ignore_eos=True),
    ]
    return prompts, [kinds[i % len(kinds)](i) for i in range(len(prompts))]


def _run(graphs: bool, compiled: bool) -> tuple[list[list[int]], int]:
    vocab = resolve_model(EMBEDDED).config.vocab_size
    prompts, params = _requests(vocab)
    engine = InProcessEngine(
        EMBEDDED,
        device=CUDA,
        max_batch_tokens=64,
        max_num_seqs=8,
        cuda_graphs=graphs,
        compile_decode=compiled,
    )
    replays = 0
    find = engine.runner.graphs.find

    def counting_find(step, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal replays
        graph = find(step, **kwargs)
        replays += graph is not None and step.sampling is SamplingMode.FULL
        return graph

    engine.runner.graphs.find = counting_find  # type: ignore[method-assign]
    try:
        outputs = engine.generate(prompts, params, mode="random", rng=random.Random(3))
    finally:
        engine.close()
    return outputs, replays


@pytest.mark.parametrize(
    ("graphs", "compiled"), [(True, False), (True, True)], ids=["graphs", "compiled"]
)
def test_full_decode_graphs_sample_what_eager_steps_sample(graphs: bool, compiled: bool) -> None:
    """The embedded model is trained, so its logits rarely tie: eager steps and graph bodies
    (their own matrix-product shapes, inductor's fused kernels) agree token for token."""
    eager, _ = _run(graphs=False, compiled=False)
    outputs, replays = _run(graphs, compiled)
    assert replays >= 20
    assert outputs == eager


def test_greedy_penalties_match_generate_on_cuda() -> None:
    vocab = resolve_model(EMBEDDED).config.vocab_size
    prompts, params = _requests(vocab)
    outputs, _ = _run(graphs=True, compiled=False)
    for prompt, sp, output in zip(prompts, params, outputs, strict=True):
        if not sp.is_greedy or sp.presence_penalty or sp.frequency_penalty:
            continue
        options: dict[str, object] = {}
        if sp.repetition_penalty != 1.0:
            options["repetition_penalty"] = sp.repetition_penalty
        if sp.logit_bias:
            options["sequence_bias"] = {(t,): b for t, b in sp.logit_bias}
        expected = reference_greedy(
            EMBEDDED, prompt, sp.max_new_tokens, None, device=CUDA, **options
        )
        assert output == expected, f"prompt of {len(prompt)} tokens, {sp}"


@pytest.mark.parametrize("compiled", [False, True], ids=["graphs", "compiled"])
def test_constrained_requests_on_cuda_sample_what_the_cpu_engine_does(compiled: bool) -> None:
    """Structured output's masks rewrite state rows before FULL steps, eager and replayed:
    the embedded model's constrained and unconstrained requests, in an asynchronous pipeline
    on CUDA, give the tokens the CPU engine gives (``test_structured_output.py`` checks those
    against ``generate``), and a step with masks never waits on the device."""
    from tests.correctness.test_structured_output import EOS, MODEL, _workload

    cpu = InProcessEngine(MODEL, eos_token_ids=EOS, max_num_seqs=8, max_batch_tokens=64)
    cases = _workload(random.Random(5), cpu.vocab_size)
    prompts, params = [p for p, _ in cases], [sp for _, sp in cases]
    expected = cpu.generate(prompts, params, mode="sync")
    engine = InProcessEngine(
        MODEL,
        device=CUDA,
        eos_token_ids=EOS,
        max_num_seqs=8,
        max_batch_tokens=64,
        compile_decode=compiled,
    )
    try:
        assert engine.generate(prompts, params, mode="async") == expected
        engine.add([5, 6, 7], params[0])
        step = engine.packer.pack(engine.scheduler.schedule(), 0, None)
        assert step.num_token_masks == 1
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = engine.runner.launch(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        launched.wait()
    finally:
        engine.close()


@pytest.mark.parametrize("batch", [32, 256])
def test_the_compiled_full_sampler_at_a_large_vocabulary_samples_what_eager_does(
    batch: int,
) -> None:
    """``torch.compile`` of the full sampler as the decode graphs run it (dynamic shapes,
    the runner's options: the kernels' ops), at Llama 3's 128,256 tokens, both variants,
    against the plain-torch reference run eagerly, and the top alternatives from its
    ``lse``. The engine tests' small vocabularies never met what inductor does with a row
    that long: a split scan for top-p's running mass, whose code
    generation failed at start-up of every 8B and 1B engine once the compiled path became
    the default."""
    from cbpipe.worker.compiling import compile_decode_fn
    from cbpipe.worker.sampler import sample_full, sample_full_reference, top_alternatives
    from tests.unit.test_full_sampler import full_inputs

    # Dynamo keeps at most 8 compiled variants of a function per process and runs it eagerly
    # after that: the tests before this one compiled the sampler at other vocabularies.
    torch._dynamo.reset()
    vocab, state_rows = 128_256, batch + 1
    gen = torch.Generator(device=CUDA).manual_seed(3)
    logits = torch.randn(batch, vocab, device=CUDA, generator=gen).to(torch.bfloat16) * 4
    bias = torch.zeros(state_rows, vocab, device=CUDA)
    counts = torch.randint(0, 2, (state_rows, vocab), device=CUDA, generator=gen).int()
    seen = counts > 0

    compiled = compile_decode_fn(sample_full)
    for truncation in (False, True):
        inputs = full_inputs(
            batch, CUDA, temperature=0.8, top_p=0.9, top_k=50, min_p=0.02,
            presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1,
            output_index=4, truncation=truncation,
        )  # fmt: skip
        eager = sample_full_reference(logits, bias, counts, seen, inputs)
        result = compiled(logits, bias, counts, seen, inputs)
        same = (result.ids == eager.ids).float().mean().item()
        assert same >= 0.95, (truncation, same)  # ties may round apart
        torch.testing.assert_close(result.lse, eager.lse)
        top_ids, top_logprobs = top_alternatives(logits.float(), result.lse)
        # The best alternative is a largest logit: bfloat16 logits tie at the top of a
        # 128,256-token row often enough that which of the tied ids comes first is topk's
        # choice, and argmax's may differ.
        best = logits.float().max(-1).values
        assert (logits.float().gather(-1, top_ids[:, :1].long())[:, 0] == best).all()
        torch.testing.assert_close(top_logprobs[:, 0], best - result.lse)
