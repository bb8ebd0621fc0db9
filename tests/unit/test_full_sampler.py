"""The full sampler (``sampler.sample_full``) and its processors, against transformers' own
logits processors where they exist and plain arithmetic where they do not (OpenAI's presence
and frequency penalties)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cbpipe.protocol.sampling import MAX_TOP_LOGPROBS
from cbpipe.worker.sampler import (
    FullSamplingInputs,
    SamplingInputs,
    _apply_top_k_top_p,
    apply_min_p,
    apply_penalties,
    prompt_logprobs,
    sample,
    sample_full,
    top_alternatives,
)
from cbpipe.worker.sampling_state import SamplingState

VOCAB = 300


def full_inputs(
    n: int, device: torch.device | str = "cpu", **overrides: object
) -> FullSamplingInputs:
    def column(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((n,), value, dtype=dtype, device=device)

    fields: dict[str, object] = dict(
        temperature=column(1.0),
        top_p=column(1.0),
        top_k=column(0, torch.int32),
        min_p=column(0.0),
        presence_penalty=column(0.0),
        frequency_penalty=column(0.0),
        repetition_penalty=column(1.0),
        seed=torch.arange(n, device=device),
        output_index=column(0, torch.int32),
        rows=torch.arange(n, device=device),
        truncation=False,
    )
    for name, value in overrides.items():
        current = fields[name]
        if isinstance(current, torch.Tensor) and not isinstance(value, torch.Tensor):
            value = column(value, current.dtype)  # type: ignore[arg-type]
        fields[name] = value
    return FullSamplingInputs(**fields)  # type: ignore[arg-type]


def empty_state(n: int) -> SamplingState:
    return SamplingState.allocate(n, VOCAB, torch.device("cpu"))


def run_full(
    logits: torch.Tensor, state: SamplingState, **overrides: object
) -> tuple[torch.Tensor, ...]:
    result = sample_full(
        logits,
        state.bias,
        state.output_counts,
        state.seen,
        full_inputs(logits.shape[0], **overrides),
    )
    return tuple(result)


def finite(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x)


def test_repetition_penalty_matches_transformers() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 3
    history = torch.randint(0, VOCAB, (4, 40))  # prompt and outputs, with repeats
    seen = torch.zeros(4, VOCAB, dtype=torch.bool).scatter_(1, history, True)
    for penalty in (1.3, 0.7):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(history, logits.clone())
        counts = torch.zeros(4, VOCAB, dtype=torch.int32)
        got = apply_penalties(
            logits,
            counts,
            seen,
            presence=torch.zeros(4),
            frequency=torch.zeros(4),
            repetition=torch.full((4,), penalty),
        )
        assert torch.equal(got, expected)


def test_presence_and_frequency_penalties_are_openais_arithmetic() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    outputs = [[5, 5, 7], [], [1, 2, 2, 2, 299]]
    presence, frequency = torch.tensor([0.5, 1.0, -0.4]), torch.tensor([0.3, -1.2, 1.5])
    counts = torch.zeros(3, VOCAB, dtype=torch.int32)
    for row, tokens in enumerate(outputs):
        for token in tokens:
            counts[row, token] += 1
    got = apply_penalties(
        logits,
        counts,
        counts > 0,
        presence=presence,
        frequency=frequency,
        repetition=torch.ones(3),
    )
    expected = logits.clone()
    for row, tokens in enumerate(outputs):
        for token in set(tokens):
            c = tokens.count(token)
            expected[row, token] -= frequency[row] * c + presence[row]
    torch.testing.assert_close(got, expected)


def test_neutral_penalties_leave_every_logit_exactly() -> None:
    logits = torch.randn(3, VOCAB)
    logits[0, :5] = float("-inf")
    counts = torch.randint(0, 4, (3, VOCAB), dtype=torch.int32)
    got = apply_penalties(
        logits,
        counts,
        counts > 0,
        presence=torch.zeros(3),
        frequency=torch.zeros(3),
        repetition=torch.ones(3),
    )
    assert torch.equal(got, logits)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_matches_transformers(min_p: float) -> None:
    torch.manual_seed(2)
    logits = torch.randn(5, VOCAB) * 2
    expected = MinPLogitsWarper(min_p)(None, logits.clone())
    got = apply_min_p(logits, torch.full((5,), min_p))
    assert torch.equal(finite(got), finite(expected))
    assert torch.equal(got[finite(got)], logits[finite(got)])
    assert torch.equal(apply_min_p(logits, torch.zeros(5)), logits)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.5), (10, 1.0), (40, 0.8), (0, 1.0)])
def test_top_k_then_top_p_match_transformers(top_k: int, top_p: float) -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, VOCAB) * 2
    expected = logits.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = _apply_top_k_top_p(
        logits, torch.full((6,), top_k, dtype=torch.int32), torch.full((6,), top_p)
    )
    assert torch.equal(finite(got), finite(expected))
    assert torch.equal(got[finite(got)], logits[finite(got)])


def test_a_row_without_truncation_keeps_its_whole_tail_exactly() -> None:
    # Many tiny probabilities: the running mass rounds to 1 before the tail ends.
    logits = torch.cat([torch.full((1, 1), 30.0), torch.zeros(1, 100_000)], dim=1)
    got = _apply_top_k_top_p(logits, torch.zeros(1, dtype=torch.int32), torch.ones(1))
    assert torch.equal(got, logits)


def test_logit_bias_matches_sequence_bias_and_the_last_entry_wins() -> None:
    torch.manual_seed(4)
    logits = torch.randn(2, VOCAB)
    state = empty_state(2)
    rows = torch.tensor([0, 0, 1, 0, 1])
    tokens = torch.tensor([3, 9, 3, 3, VOCAB + 7])  # row 0 token 3 twice; one outside
    values = torch.tensor([5.0, -2.0, 1.5, -7.0, 4.0])
    state.apply_bias(rows, tokens, values)
    assert state.bias[0, 3] == -7.0 and state.bias[0, 9] == -2.0 and state.bias[1, 3] == 1.5
    assert int((state.bias[:2] != 0).sum()) == 3  # the spare row takes what is dropped
    expected = SequenceBiasLogitsProcessor([[[3], -7.0], [[9], -2.0]])(
        torch.zeros(1, 1, dtype=torch.long), logits[:1].clone()
    )
    greedy = run_full(logits[:1], state, temperature=0.0)
    assert greedy[0].item() == expected.argmax().item()
    biased = logits[:1] + state.bias[:1]
    torch.testing.assert_close(biased, expected)


def test_the_min_tokens_ban_matches_transformers() -> None:
    torch.manual_seed(5)
    logits = torch.randn(1, VOCAB)
    eos = [int(logits.argmax()), 17]  # the top token is an EOS: banned, the next wins
    state = empty_state(1)
    state.apply_bias(torch.zeros(2), torch.tensor(eos), torch.full((2,), float("-inf")))
    prompt = torch.zeros(1, 4, dtype=torch.long)
    banned = MinNewTokensLengthLogitsProcessor(4, 3, eos)(prompt, logits.clone())
    ids, logprobs = run_full(logits, state, temperature=0.0)[:2]
    assert ids.item() == banned.argmax().item() != eos[0]
    # Log-probabilities stay the model's own: the ban changes the choice, not the numbers.
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[:, ids[0]])
    state.apply_bias(torch.zeros(2), torch.tensor(eos), torch.zeros(2))  # the ban lifted
    assert run_full(logits, state, temperature=0.0)[0].item() == eos[0]


def test_full_sampling_of_an_unprocessed_row_draws_what_sample_draws() -> None:
    torch.manual_seed(6)
    n = 64
    logits = torch.randn(n, VOCAB) * 2
    temperature = torch.rand(n) + 0.2
    temperature[::5] = 0.0
    seeds = torch.randint(0, 2**40, (n,))
    index = torch.randint(0, 1000, (n,), dtype=torch.int32)
    plain = sample(logits, SamplingInputs(temperature, seeds, index, all_greedy=False))
    state = empty_state(n)
    for truncation in (False, True):
        ids, logprobs, _ = run_full(
            logits,
            state,
            temperature=temperature,
            seed=seeds,
            output_index=index,
            truncation=truncation,
        )
        assert torch.equal(ids, plain[0])
        assert torch.equal(logprobs, plain[1])


def test_greedy_rows_take_the_argmax_of_the_processed_logits() -> None:
    torch.manual_seed(7)
    logits = torch.randn(3, VOCAB)
    state = empty_state(3)
    top = logits.argmax(-1)
    state.output_counts[torch.arange(3), top] = 2  # each row's top token was output twice
    state.seen[torch.arange(3), top] = True
    ids = run_full(logits, state, temperature=0.0, frequency_penalty=10.0)[0]
    expected = logits.clone()
    expected[torch.arange(3), top] -= 20.0
    assert torch.equal(ids, expected.argmax(-1))


def test_full_sampling_follows_the_processed_distribution() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5, -3.0, 1.5]).repeat(20000, 1)
    state = SamplingState.allocate(1, 6, torch.device("cpu"))
    state.bias[0, 2] = -1.0
    rows = torch.zeros(20000, dtype=torch.long)
    result = sample_full(
        logits,
        state.bias,
        state.output_counts,
        state.seen,
        full_inputs(20000, rows=rows, temperature=0.7, top_k=4, min_p=0.1, truncation=True),
    )
    processed = (logits[0] + state.bias[0]) / 0.7
    keep = processed >= processed.sort(descending=True).values[3]  # top-4
    keep &= (processed - processed.max()).exp() >= 0.1
    expected = processed.masked_fill(~keep, float("-inf")).softmax(-1)
    frequencies = torch.bincount(result.ids, minlength=6) / 20000
    torch.testing.assert_close(frequencies, expected, atol=0.015, rtol=0)
    torch.testing.assert_close(result.logprobs, logits[0].log_softmax(-1)[result.ids])


def test_top_alternatives_are_torch_topk_of_the_raw_log_softmax() -> None:
    torch.manual_seed(8)
    logits = torch.randn(5, VOCAB) * 4
    state = empty_state(5)
    state.bias[:, :50] = 10.0  # processing changes the sample, not the alternatives
    ids, logprobs, lse = run_full(logits, state)
    top_ids, top_logprobs = top_alternatives(logits, lse)
    values, expected_ids = torch.topk(logits.log_softmax(-1), MAX_TOP_LOGPROBS)
    assert top_ids.dtype == torch.int32 and torch.equal(top_ids.long(), expected_ids)
    torch.testing.assert_close(top_logprobs, values)
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).gather(-1, ids[:, None])[:, 0])
    assert bool((ids < 50).all())


def test_prompt_logprobs_are_the_raw_log_softmax_at_the_targets() -> None:
    torch.manual_seed(9)
    logits = torch.randn(7, VOCAB).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (7,))
    got, top_ids, top_logprobs = prompt_logprobs(logits, targets)
    reference = logits.float().log_softmax(-1)
    torch.testing.assert_close(got, reference.gather(-1, targets[:, None])[:, 0])
    values, ids = torch.topk(reference, MAX_TOP_LOGPROBS)
    assert torch.equal(top_ids.long(), ids)
    torch.testing.assert_close(top_logprobs, values)


def test_a_small_vocabulary_pads_the_alternatives() -> None:
    logits = torch.randn(2, 8)
    _, top_ids, top_logprobs = prompt_logprobs(logits, torch.zeros(2, dtype=torch.long))
    assert top_ids.shape == top_logprobs.shape == (2, MAX_TOP_LOGPROBS)
    assert bool(torch.isinf(top_logprobs[:, 8:]).all())


def test_a_step_with_alternatives_runs_the_compiled_sampler_of_one_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The top alternatives are taken after the compiled sampler, so asking for them is no
    guard of its: dynamo traces the sampler once for both, where each was a start-up trace
    of its own. Dynamo alone here (the eager backend): what is counted is its tracing."""
    from torch._dynamo.utils import counters

    from cbpipe.protocol.slots import SlotLayout, SlotLimits
    from cbpipe.worker import step_sampling
    from cbpipe.worker.step_sampling import StepSampling, device_slot

    def compile_with_dynamo_alone(fn):  # type: ignore[no-untyped-def]
        return torch.compile(fn, dynamic=True, backend="eager")

    monkeypatch.setattr(step_sampling, "compile_decode_fn", compile_with_dynamo_alone)
    torch._dynamo.reset()
    counters.clear()
    n, cpu = 4, torch.device("cpu")
    sampling = StepSampling(SamplingState.allocate(n + 1, VOCAB, cpu), n, cpu, compiled=True)
    slot = device_slot(SlotLayout.build(SlotLimits(16, n, 4)), cpu)
    slot.inputs.temperature[:n] = 0.8
    logits, rows = torch.randn(n, VOCAB) * 3, torch.arange(n)
    graphs = []
    for top_logprobs in (False, True, False):
        sampling.sample_full(slot, logits, n, rows, False, top_logprobs,
                             sampler=sampling._graph_full_samplers[False])  # fmt: skip
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and len(set(graphs)) == 1, f"graphs after each step: {graphs}"
    values, ids = torch.topk(logits.log_softmax(-1), MAX_TOP_LOGPROBS)
    k = MAX_TOP_LOGPROBS
    assert torch.equal(slot.outputs.top_ids[: n * k].view(n, k).long(), ids)
    torch.testing.assert_close(slot.outputs.top_logprobs[: n * k].view(n, k), values)
