"""Prefix caching against transformers' ``generate``: requests that share prompt prefixes get
the same tokens as without the cache, while the cache really serves them (hits are counted).

Every step of these runs checks the block bookkeeping (``Scheduler.check_invariants``, called
by the harness), and every run ends with all blocks free or cached.
"""

from __future__ import annotations

import random

import pytest

from cbpipe.protocol.sampling import SamplingParams
from tests.harness import InProcessEngine, reference_greedy

QWEN = "random:qwen2-tiny"
BLOCK = 8


def engine(**overrides: object) -> InProcessEngine:
    settings: dict[str, object] = {
        "num_blocks": 128,
        "block_size": BLOCK,
        "max_num_seqs": 8,
        "max_batch_tokens": 96,
    }
    settings.update(overrides)
    return InProcessEngine(QWEN, **settings)  # type: ignore[arg-type]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def check(
    run: InProcessEngine, prompts: list[list[int]], outputs: list[list[int]], max_new: int
) -> None:
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == reference_greedy(QWEN, prompt, max_new, None), f"{len(prompt)} tokens"
    assert run.blocks.num_free_blocks == run.num_blocks  # free or cached, none held


def greedy(max_new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, ignore_eos=True)


@pytest.mark.parametrize(
    ("mode", "prefill"), [("async", "torch"), ("sync", "torch"), ("async", "triton")]
)
def test_a_shared_system_prompt_is_computed_once(mode: str, prefill: str) -> None:
    """``triton``: the varlen prefill kernel (under Triton's interpreter here) reads the
    cached blocks, some written by the same step."""
    rng = random.Random(1)
    system = tokens(rng, 40)  # five blocks
    prompts = [system + tokens(rng, rng.randint(1, 20)) for _ in range(12)]
    run = engine(prefill_backend=prefill)
    outputs = run.generate(prompts, [greedy(6)] * len(prompts), mode=mode)
    check(run, prompts, outputs, 6)
    # The first computes the system prompt; the other eleven find its five blocks.
    assert run.blocks.num_hit_tokens >= 11 * 40


def test_multi_turn_conversations_reuse_their_history() -> None:
    rng = random.Random(2)
    run = engine()
    histories = [tokens(rng, rng.randint(5, 30)) for _ in range(4)]
    for turn in range(4):
        outputs = run.generate(histories, [greedy(12)] * len(histories))
        check(run, histories, outputs, 12)
        hits_before = run.blocks.num_hit_tokens
        histories = [h + o + tokens(rng, 5) for h, o in zip(histories, outputs, strict=True)]
        if turn:
            assert run.blocks.num_hit_tokens == hits_before
    assert run.blocks.num_hit_tokens > 0
    for history in histories:  # each turn found the one before it: its full blocks
        assert len(history) > 3 * BLOCK


@pytest.mark.parametrize("shared", [4 * BLOCK - 1, 4 * BLOCK, 4 * BLOCK + 1])
def test_prompts_that_differ_after_a_shared_part(shared: int) -> None:
    """Shared parts ending just before, on and just after a block boundary: only whole
    blocks of shared tokens are found."""
    rng = random.Random(shared)
    base = tokens(rng, shared)
    prompts = [base + [rng.randrange(3, 512)] + tokens(rng, i) for i in range(4)]
    run = engine()
    first = run.generate(prompts[:1], [greedy(5)])
    rest = run.generate(prompts[1:], [greedy(5)] * 3)
    check(run, prompts, first + rest, 5)
    assert run.blocks.num_hit_tokens == 3 * (shared // BLOCK) * BLOCK


def test_identical_prompts_of_whole_blocks_still_compute_their_last_token() -> None:
    rng = random.Random(4)
    prompt = tokens(rng, 3 * BLOCK)
    run = engine()
    first = run.generate([prompt], [greedy(5)])
    again = run.generate([prompt, prompt], [greedy(5)] * 2)
    check(run, [prompt] * 3, first + again, 5)
    assert run.blocks.num_hit_tokens == 2 * 2 * BLOCK  # two of three blocks, twice


def test_samples_of_one_prompt_share_it_and_match_the_uncached_draws() -> None:
    rng = random.Random(5)
    prompt = tokens(rng, 45)
    params = [SamplingParams(12, temperature=1.0, seed=s, ignore_eos=True) for s in range(5)]
    cached, uncached = engine(), engine(prefix_caching=False)
    with_cache = cached.generate([prompt] * 5, params)
    assert with_cache == uncached.generate([prompt] * 5, params)
    assert cached.blocks.num_hit_tokens == 4 * 40 and uncached.blocks.num_hit_tokens == 0


def test_a_request_arriving_while_its_prefix_is_prefilled() -> None:
    """The prefix is computed in chunks over several steps; a request sharing it arrives
    midway. The first takes the whole token budget until its last chunk, so the second starts
    in the step that computes that chunk: it reads blocks written in its own step (every
    layer writes the step's keys before it attends) and in the steps still in flight."""
    rng = random.Random(6)
    prefix = tokens(rng, 200)
    first, second = prefix + tokens(rng, 3), prefix + tokens(rng, 4)
    run = engine(max_batch_tokens=32)
    added = run.run(arrivals={1: [(first, greedy(6))], 4: [(second, greedy(6))]})
    check(run, [first, second], [r.output_token_ids for r in added], 6)
    assert run.blocks.num_hit_tokens == 200


@pytest.mark.parametrize("mode", ["async", "random"])
def test_preemption_and_cancellation_under_a_tiny_cache(mode: str) -> None:
    rng = random.Random(7)
    system = tokens(rng, 24)
    prompts = [system + tokens(rng, rng.randint(1, 40)) for _ in range(16)]
    run = engine(num_blocks=24, max_num_seqs=6, max_batch_tokens=64)
    arrivals = {1 + i: [(p, greedy(20))] for i, p in enumerate(prompts)}
    added = run.run(mode=mode, rng=random.Random(8), arrivals=arrivals, cancel_probability=0.05)
    assert any(r.num_preemptions for r in added), "the cache was not small enough"
    assert run.blocks.num_hit_tokens > 0
    finished = [
        (r.prompt_token_ids, r.output_token_ids) for r in added if len(r.output_token_ids) == 20
    ]
    assert finished
    for prompt, output in finished:
        assert output == reference_greedy(QWEN, prompt, 20, None)
    assert run.blocks.num_free_blocks == run.num_blocks


def test_requests_with_penalties_or_prompt_logprobs_do_not_read_the_cache() -> None:
    """Their device state (penalty counts, bias rows) and their prompt log-probabilities come
    from the prompt's rows: they compute the prompt whole, and still publish it."""
    rng = random.Random(9)
    prompt = tokens(rng, 40)
    run = engine()
    run.generate([prompt], [SamplingParams(4, repetition_penalty=1.3, ignore_eos=True)])
    run.generate([prompt], [SamplingParams(4, prompt_logprobs=1, ignore_eos=True)])
    assert run.blocks.num_hit_tokens == 0
    run.generate([prompt], [greedy(4)])
    assert run.blocks.num_hit_tokens == 32  # published by the first


def test_a_request_after_a_cached_prefix_starts_from_a_clean_device_row() -> None:
    """One request row: the second request takes the row the first biased, and starts after
    the first's cached prompt, never at position 0. Its full sampler must not see the bias."""
    rng = random.Random(10)
    prompt = tokens(rng, 40)
    suffix = prompt + tokens(rng, 5)
    expected = reference_greedy(QWEN, suffix, 6, None)
    favoured = next(t for t in range(3, 512) if t not in expected)
    run = engine(max_num_seqs=1)
    biased = SamplingParams(6, logit_bias=((favoured, 100.0),), ignore_eos=True)
    assert run.generate([prompt], [biased]) == [[favoured] * 6]
    # top_k makes it a FULL request (the bias row is read), and greedy is still greedy.
    full_greedy = SamplingParams(6, top_k=5, ignore_eos=True)
    assert run.generate([suffix], [full_greedy]) == [expected]
    assert run.blocks.num_hit_tokens == 40


@pytest.mark.parametrize("prefill", ["torch", "triton"])
def test_a_long_shared_prefix_is_read_through_either_prefill_path(prefill: str) -> None:
    """A 2,000-token system prompt, as the H200 benchmark shares: the prefill of each later
    request reads 250 cached blocks (many key tiles of the varlen kernel, interpreted here)
    before its own rows, in chunks of the step budget."""
    rng = random.Random(12)
    system = tokens(rng, 2000)
    prompts = [system + tokens(rng, rng.randint(5, 40)) for _ in range(4)]
    run = engine(num_blocks=1024, max_batch_tokens=256, max_model_len=4096, prefill_backend=prefill)
    outputs = run.generate(prompts[:1], [greedy(6)]) + run.generate(prompts[1:], [greedy(6)] * 3)
    check(run, prompts, outputs, 6)
    assert run.blocks.num_hit_tokens == 3 * 2000
