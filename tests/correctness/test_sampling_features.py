"""Per-request sampling features through the engine, against transformers and references.

The scheduler core, the packer and the worker's runner in the engine's call order
(``tests/harness.py``), float32 on the CPU: greedy decoding with a repetition penalty, a
logit bias and ``min_tokens`` equals transformers' ``generate`` with the same processors;
presence and frequency penalties equal ``generate`` with a processor written out here as
OpenAI defines them; prompt log-probabilities and top alternatives equal ``log_softmax`` of
the model's own forward; seeded sampling draws the same in every mode and every crowd. The
device state is checked against the tokens after each run, including after preemptions and
with rows reused, and FULL decode steps run through the padded graph bodies too.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from transformers import LogitsProcessor

from cbpipe.models import EMBEDDED_MODEL_DIR, resolve_model
from cbpipe.protocol.messages import SamplingMode, Step
from cbpipe.protocol.sampling import SamplingParams
from cbpipe.scheduler.request import Request
from cbpipe.worker.cuda_graphs import Replayable
from tests.harness import InProcessEngine, reference_greedy, reference_model

QWEN = "random:qwen2-tiny"
EMBEDDED = "default"
VOCAB = 512

needs_embedded = pytest.mark.skipif(
    not (EMBEDDED_MODEL_DIR / "config.json").exists(), reason="embedded model not built"
)


def _prompts(rng: random.Random, count: int, longest: int, vocab: int = VOCAB) -> list[list[int]]:
    lengths = [1, 2, longest] + [rng.randint(1, longest) for _ in range(count - 3)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


_REFERENCES: dict[str, list[int]] = {}


def reference_generate(
    name: str,
    prompt: list[int],
    max_new_tokens: int,
    eos: list[int] | None = None,
    processors: list[LogitsProcessor] | None = None,
    **kwargs: object,
) -> list[int]:
    """Greedy ``generate`` of transformers with extra processors or generation options
    (remembered across the tests' modes: the processors' reprs say what they do)."""
    key = repr((name, prompt, max_new_tokens, eos, processors, sorted(kwargs.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_greedy(name, prompt, max_new_tokens, eos, processors, **kwargs)
    return _REFERENCES[key]


class OpenAIPenalties(LogitsProcessor):
    """``logit - frequency * count - presence * (count > 0)`` over the generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __repr__(self) -> str:
        return f"OpenAIPenalties({self.prompt_len}, {self.presence}, {self.frequency})"

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        outputs = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, outputs, torch.ones_like(outputs).float())
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


class RowRecorder:
    """The request row each request had the last time a step held it, and the last request
    in each row, read from the packed plans."""

    def __init__(self, engine: InProcessEngine) -> None:
        self.row_of: dict[int, int] = {}
        self.last_in_row: dict[int, Request] = {}
        pack = engine.packer.pack

        def recording_pack(plan, slot, previous):  # type: ignore[no-untyped-def]
            for seq in plan.seqs:
                row = seq.req.table_row
                self.row_of[seq.req.request_id] = row
                self.last_in_row[row] = seq.req
            return pack(plan, slot, previous)

        engine.packer.pack = recording_pack  # type: ignore[method-assign]


def check_final_state(engine: InProcessEngine, recorder: RowRecorder) -> None:
    """Each row's device state holds exactly its last request's tokens (every request ran to
    its length: no wasted rows)."""
    state = engine.runner.state
    checked = 0
    for row, req in recorder.last_in_row.items():
        if recorder.row_of[req.request_id] != row:
            continue  # preempted from this row, and resumed in another
        checked += 1
        outputs = req.output_token_ids
        expected = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=state.vocab)
        assert torch.equal(state.output_counts[row].long(), expected), f"row {row}"
        seen = torch.zeros(state.vocab, dtype=torch.bool)
        seen[req.prompt_token_ids + outputs] = True
        assert torch.equal(state.seen[row], seen), f"row {row}"
        assert int(state.num_counted[row]) == req.num_prompt_tokens + len(outputs)
    assert checked


def count_replays(engine: InProcessEngine) -> list[tuple[Step, Replayable | None]]:
    """Record every step the runner looks a graph up for, and what it found."""
    found: list[tuple[Step, Replayable | None]] = []
    find = engine.runner.graphs.find

    def counting_find(step: Step, **kwargs: bool) -> Replayable | None:
        found.append((step, find(step, **kwargs)))
        return found[-1][1]

    engine.runner.graphs.find = counting_find  # type: ignore[method-assign]
    return found


@pytest.mark.parametrize("mode", ["async", "random"])
def test_repetition_penalty_bias_and_min_tokens_match_generate(mode: str) -> None:
    rng = random.Random(11)
    prompts = _prompts(rng, count=12, longest=120)
    free_runs = [reference_generate(QWEN, p, 10) for p in prompts]
    cases: list[tuple[SamplingParams, dict[str, object]]] = []
    for i in range(len(prompts)):
        favoured = free_runs[i][3]
        bias = ((favoured, -5.0), (rng.randrange(VOCAB), 4.0))
        penalty = [1.0, 1.4, 0.8][i % 3]
        min_tokens = [0, 3, 6][i % 3]
        params = SamplingParams(
            max_new_tokens=12, repetition_penalty=penalty, logit_bias=bias, min_tokens=min_tokens
        )
        options: dict[str, object] = {"sequence_bias": {(t,): b for t, b in bias}}
        if penalty != 1.0:
            options["repetition_penalty"] = penalty
        cases.append((params, options))
    # As EOS, tokens that these runs emit early; the bans of min_tokens then matter.
    unbanned = [
        reference_generate(QWEN, p, 12, None, **o) for p, (_, o) in zip(prompts, cases, strict=True)
    ]
    eos = sorted({run[2] for run in unbanned[:6]})
    for params, options in cases:
        if params.min_tokens:
            options["min_new_tokens"] = params.min_tokens
    early = [
        any(t in eos for t in run[: params.min_tokens])
        for run, (params, _) in zip(unbanned, cases, strict=True)
    ]
    assert any(early), "no ban of min_tokens held back an EOS"
    engine = InProcessEngine(
        QWEN, max_batch_tokens=48, max_num_seqs=5, eos_token_ids=frozenset(eos)
    )
    outputs = engine.generate(prompts, [p for p, _ in cases], mode=mode, rng=random.Random(3))
    for prompt, (params, options), output in zip(prompts, cases, outputs, strict=True):
        assert output == reference_generate(QWEN, prompt, 12, eos, **options)
        ends = [i for i, t in enumerate(output) if t in eos]
        assert not ends or ends[0] >= params.min_tokens
    assert any(len(o) < 12 for o in outputs), "no request stopped at EOS"
    assert engine.blocks.num_free_blocks == engine.num_blocks


def _penalty_params(rng: random.Random, count: int, max_new_tokens: int) -> list[SamplingParams]:
    choices = [(0.0, 0.0, 1.0), (1.5, 0.0, 1.0), (0.0, 1.0, 1.0), (0.7, 0.6, 1.3), (-0.5, 0.3, 1.0)]
    return [
        SamplingParams(
            max_new_tokens=max_new_tokens,
            presence_penalty=choices[i % len(choices)][0],
            frequency_penalty=choices[i % len(choices)][1],
            repetition_penalty=choices[i % len(choices)][2],
            ignore_eos=True,
        )
        for i in range(count)
    ]


def _penalty_reference(prompt: list[int], params: SamplingParams) -> list[int]:
    processors = [OpenAIPenalties(len(prompt), params.presence_penalty, params.frequency_penalty)]
    options: dict[str, object] = {}
    if params.repetition_penalty != 1.0:
        options["repetition_penalty"] = params.repetition_penalty
    return reference_generate(QWEN, prompt, params.max_new_tokens, None, processors, **options)


@pytest.mark.parametrize("mode", ["async", "sync", "random"])
def test_presence_and_frequency_penalties_match_a_reference_loop(mode: str) -> None:
    """More requests than rows (rows are reused and reset), three steps in flight."""
    rng = random.Random(12)
    prompts = _prompts(rng, count=10, longest=100)
    params = _penalty_params(rng, len(prompts), max_new_tokens=14)
    engine = InProcessEngine(QWEN, max_batch_tokens=40, max_num_seqs=5)
    recorder = RowRecorder(engine)
    outputs = engine.generate(prompts, params, mode=mode, rng=random.Random(4))
    for prompt, sp, output in zip(prompts, params, outputs, strict=True):
        assert output == _penalty_reference(prompt, sp)
    assert len(recorder.row_of) > 5 and len(recorder.last_in_row) == 5
    check_final_state(engine, recorder)
    plain = engine.generate(prompts[:5], [SamplingParams(14, ignore_eos=True)] * 5)
    assert plain != outputs[:5], "the penalties changed nothing"


def test_penalties_survive_preemption_by_recompute() -> None:
    rng = random.Random(13)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(20, 60))] for _ in range(8)]
    params = _penalty_params(rng, len(prompts), max_new_tokens=24)
    engine = InProcessEngine(
        QWEN, num_blocks=14, block_size=8, max_num_seqs=8, max_batch_tokens=64, max_model_len=112
    )
    recorder = RowRecorder(engine)
    reqs = [engine.add(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.run(mode="async")
    assert sum(r.num_preemptions for r in reqs) > 0, "the cache was never short"
    for req in reqs:
        assert req.output_token_ids == _penalty_reference(req.prompt_token_ids, req.params)
    check_final_state(engine, recorder)


def _collect_updates(engine: InProcessEngine) -> dict[int, list]:
    """Every update the scheduler applies, per request id."""
    updates: dict[int, list] = {}
    update = engine.scheduler.update

    def collecting_update(plan, output):  # type: ignore[no-untyped-def]
        result = update(plan, output)
        for item in result:
            updates.setdefault(item.req.request_id, []).append(item)
        return result

    engine.scheduler.update = collecting_update  # type: ignore[method-assign]
    return updates


def _log_softmax_of(name: str, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = reference_model(name)(torch.tensor([tokens])).logits[0]
    return logits.float().log_softmax(-1)  # [len(tokens), vocab]


@pytest.mark.parametrize(
    ("max_batch_tokens", "max_num_seqs"), [(48, 4), (4, 4)], ids=["chunks", "one-row-chunks"]
)
def test_prompt_logprobs_equal_log_softmax_of_the_models_forward(
    max_batch_tokens: int, max_num_seqs: int
) -> None:
    """Prompts longer than the token budget (chunks attend to earlier chunks), beside decodes
    and requests without prompt log-probabilities; with a budget of 4 for 4 sequences most
    chunks are a single row."""
    rng = random.Random(14)
    prompts = _prompts(rng, count=8, longest=70)
    params = [
        SamplingParams(max_new_tokens=4, prompt_logprobs=[None, 0, 5, 20][i % 4])
        for i in range(len(prompts))
    ]
    engine = InProcessEngine(QWEN, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs)
    reqs = [engine.add(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.run(mode="random", rng=random.Random(5))
    for req in reqs:
        k = req.params.prompt_logprobs
        buffer = req.prompt_logprobs
        if k is None or len(req.prompt_token_ids) < 2:
            assert buffer is None
            continue
        assert buffer is not None and buffer.complete
        prompt = req.prompt_token_ids
        reference = _log_softmax_of(QWEN, prompt)[:-1]  # row i predicts prompt token i + 1
        expected = reference.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(
            torch.from_numpy(buffer.logprobs[1:]), expected, atol=2e-4, rtol=0
        )
        if k:
            assert buffer.top_ids is not None and buffer.top_logprobs is not None
            values, ids = torch.topk(reference, k)
            assert torch.equal(torch.from_numpy(buffer.top_ids[1:]).long(), ids)
            torch.testing.assert_close(
                torch.from_numpy(buffer.top_logprobs[1:]), values, atol=2e-4, rtol=0
            )
        # The outputs are still greedy.
        assert req.output_token_ids == reference_generate(QWEN, prompt, 4)


def test_top_alternatives_and_logprobs_equal_log_softmax_of_the_models_forward() -> None:
    rng = random.Random(15)
    prompts = _prompts(rng, count=8, longest=60)
    params = [
        SamplingParams(max_new_tokens=8, logprobs=[0, 1, 5, 20][i % 4], ignore_eos=True)
        for i in range(len(prompts))
    ]
    params[1] = SamplingParams(max_new_tokens=8, ignore_eos=True)  # greedy, in FULL steps too
    params[2] = SamplingParams(max_new_tokens=8, temperature=0.8, seed=2, logprobs=3)
    engine = InProcessEngine(QWEN, max_batch_tokens=48, max_num_seqs=5)
    updates = _collect_updates(engine)
    reqs = [engine.add(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.run(mode="random", rng=random.Random(6))
    for req in reqs:
        tokens = req.prompt_token_ids + req.output_token_ids
        reference = _log_softmax_of(QWEN, tokens)[req.num_prompt_tokens - 1 : -1]
        got = updates[req.request_id]
        assert [u.token_id for u in got] == req.output_token_ids
        chosen = reference.gather(-1, torch.tensor(req.output_token_ids)[:, None])[:, 0]
        torch.testing.assert_close(
            torch.tensor([u.logprob for u in got]), chosen, atol=2e-4, rtol=0
        )
        k = req.params.logprobs
        for update, row in zip(got, reference, strict=True):
            if not k:
                assert update.top is None
                continue
            assert update.top is not None
            values, ids = torch.topk(row, k)
            assert torch.equal(torch.from_numpy(update.top[0]).long(), ids)
            torch.testing.assert_close(torch.from_numpy(update.top[1]), values, atol=2e-4, rtol=0)
        if req.params.is_greedy:
            assert req.output_token_ids == reference_generate(QWEN, req.prompt_token_ids, 8)


def _seeded_params(count: int) -> list[SamplingParams]:
    variants: list[Callable[[int], SamplingParams]] = [
        lambda i: SamplingParams(14, temperature=0.9, top_p=0.9, top_k=50, seed=i),
        lambda i: SamplingParams(14, temperature=1.1, min_p=0.05, presence_penalty=0.8, seed=i),
        lambda i: SamplingParams(14, temperature=0.7, repetition_penalty=1.2, logprobs=2, seed=i),
        lambda i: SamplingParams(14, temperature=1.0, seed=i),  # plain temperature
        lambda i: SamplingParams(14, temperature=1.0, frequency_penalty=0.5, seed=i, min_tokens=4),
    ]
    return [variants[i % len(variants)](i) for i in range(count)]


def test_seeded_full_sampling_is_the_same_in_every_mode_and_every_crowd() -> None:
    rng = random.Random(16)
    prompts = _prompts(rng, count=10, longest=90)
    params = _seeded_params(len(prompts))
    runs = {
        mode: InProcessEngine(QWEN, max_batch_tokens=48, max_num_seqs=6).generate(
            prompts, params, mode=mode, rng=random.Random(7)
        )
        for mode in ("async", "sync", "random")
    }
    assert runs["async"] == runs["sync"] == runs["random"]
    # Alone, each takes the cheapest sampler it needs: plain temperature alone is RANDOM.
    for index in range(5):
        alone = InProcessEngine(QWEN).generate([prompts[index]], [params[index]])[0]
        assert alone == runs["async"][index], f"request {index}"
    greedy = InProcessEngine(QWEN).generate(prompts[:5], [SamplingParams(14)] * 5)
    assert greedy != runs["async"][:5], "sampling looked greedy"


def test_a_random_request_in_a_full_crowd_draws_what_it_draws_alone() -> None:
    rng = random.Random(17)
    prompts = _prompts(rng, count=6, longest=50)
    plain = SamplingParams(16, temperature=0.8, seed=99)
    assert not plain.needs_full_sampling
    crowd = [plain] + [
        SamplingParams(16, temperature=0.8, top_p=0.8, repetition_penalty=1.5, seed=i)
        for i in range(5)
    ]
    engine = InProcessEngine(QWEN, max_batch_tokens=64, max_num_seqs=6)
    found = count_replays(engine)
    together = engine.generate(prompts, crowd)
    assert all(step.sampling is SamplingMode.FULL for step, _ in found)
    alone_engine = InProcessEngine(QWEN, max_batch_tokens=64, max_num_seqs=6)
    alone_found = count_replays(alone_engine)
    alone = alone_engine.generate(prompts[:1], [plain])[0]
    assert all(step.sampling is SamplingMode.RANDOM for step, _ in alone_found)
    assert together[0] == alone


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_row_taken_outside_full_steps_holds_nothing_of_its_last_owner(mode: str) -> None:
    """A request that needs no state takes, in a GREEDY step, the row of one that had a
    logit bias or a min_tokens ban (never lifted: it ended at min_tokens); a request that
    needs the full sampler arrives two steps later, so the first is sampled in FULL steps,
    with its row's bias. It must be its own (none): the row was cleared as it was taken."""
    rng = random.Random(23)
    first, prompt, other = ([rng.randrange(3, VOCAB) for _ in range(10)] for _ in range(3))
    expected = reference_generate(QWEN, prompt, 8)
    favoured = next(t for t in range(3, VOCAB) if t not in expected)
    # A token it outputs after the FULL steps began, as its stop token: a ban would hide it.
    end = next(i for i in range(4, 8) if expected[i] not in expected[:i])
    for owner, plain_params, plain_expected in (
        (
            SamplingParams(1, logit_bias=((favoured, 100.0),), ignore_eos=True),
            SamplingParams(8, ignore_eos=True),
            expected,
        ),
        (
            SamplingParams(2, min_tokens=2, stop_token_ids=(expected[end],)),
            SamplingParams(8, stop_token_ids=(expected[end],), ignore_eos=True),
            expected[: end + 1],
        ),
    ):
        engine = InProcessEngine(QWEN, max_num_seqs=2)
        engine.generate([first], [owner], mode=mode)
        found = count_replays(engine)
        plain, full = engine.run(
            mode=mode,
            arrivals={
                1: [(prompt, plain_params)],
                3: [(other, SamplingParams(8, top_k=5, ignore_eos=True))],
            },
        )
        assert plain.output_token_ids == plain_expected, owner
        assert full.output_token_ids == reference_generate(QWEN, other, 8)
        modes = [step.sampling for step, _ in found]
        assert modes[0] is SamplingMode.GREEDY and SamplingMode.FULL in modes, modes


@needs_embedded
def test_full_decode_graph_bodies_match_eager_steps() -> None:
    """FULL decode steps through the padded graph bodies (the Triton decode kernel under the
    interpreter), with one-token prompts (their rows restart in decode-only steps), bias
    entries that lift min_tokens bans mid-decode, top alternatives and top-k/top-p, against
    the same requests run eagerly; and the padding rows, which read stale request rows in the
    slots, leave every other request's state row alone. (Through ``torch.compile`` the CPU
    takes minutes to compile the full sampler's variants: ``tests/gpu`` runs that.)"""
    source = resolve_model(EMBEDDED)
    vocab = source.config.vocab_size
    rng = random.Random(18)
    prompts = _prompts(rng, count=7, longest=40, vocab=vocab)
    prompts[3] = [prompts[3][0]]
    eos = sorted(source.eos_token_ids)
    params = [
        SamplingParams(12, repetition_penalty=1.3, min_tokens=5, logit_bias=((7, 2.0),)),
        SamplingParams(12, temperature=0.9, top_p=0.8, seed=1, logprobs=4),
        SamplingParams(12, presence_penalty=0.5, frequency_penalty=0.4, ignore_eos=True),
        SamplingParams(12, temperature=1.2, min_p=0.1, top_k=20, seed=5, min_tokens=3),
        SamplingParams(12, logprobs=2),
        SamplingParams(12, temperature=0.7, seed=3),
        SamplingParams(12),
    ]

    def run(backend: str) -> tuple[InProcessEngine, list[list[int]], list]:
        engine = InProcessEngine(
            EMBEDDED,
            max_batch_tokens=48,
            max_num_seqs=6,
            attention_backend=backend,
            eos_token_ids=frozenset(eos),
        )
        found = count_replays(engine)
        outputs = engine.generate(prompts, params, mode="random", rng=random.Random(8))
        return engine, outputs, found

    engine, outputs, found = run("triton")
    _, eager_outputs, _ = run("torch")
    assert outputs == eager_outputs
    replayed = [step for step, graph in found if graph is not None]
    assert sum(step.sampling is SamplingMode.FULL for step in replayed) >= 6
    assert any(step.num_bias_entries for step in replayed), "no ban lifted in a graph"
    assert any(step.top_logprobs for step in replayed)

    # One more request alone: its FULL steps pad to the bucket of 6 rows, whose padding
    # rows read request rows of the finished requests above.
    before = {
        name: getattr(engine.runner.state, name).clone()
        for name in ("output_counts", "seen", "bias", "num_counted")
    }
    recorder = RowRecorder(engine)
    req = engine.add(prompts[0][:5], SamplingParams(6, repetition_penalty=1.2, ignore_eos=True))
    engine.run()
    row = recorder.row_of[req.request_id]
    assert req.output_token_ids
    for name, old in before.items():
        new = getattr(engine.runner.state, name)
        others = [r for r in range(engine.runner.state.spare_row) if r != row]
        assert torch.equal(new[others], old[others]), name
