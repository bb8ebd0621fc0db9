"""Structured output through the engine, against transformers' ``generate``.

The scheduler core, the packer and the worker's runner in the engine's call order
(``tests/harness.py``), float32 on the CPU, on the embedded model (it has a tokenizer):
greedy decoding under a constraint equals ``generate`` with a logits processor that masks
what llguidance forbids, computed one matcher at a time with its plain API (the engine fills
a step's masks in parallel, into the slot), and a stopping criterion at the grammar's end.
Constrained requests share steps with unconstrained ones, whose tokens must not change; the
texts match their constraints; sync, async and randomly deep pipelines give the same tokens.
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
from transformers import (
    AutoTokenizer,
    LogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
)

from cbpipe.models import EMBEDDED_MODEL_DIR
from cbpipe.protocol.sampling import SamplingParams, StructuredOutput
from cbpipe.scheduler.request import Request, RequestStatus
from cbpipe.scheduler.structured import Grammars
from tests.harness import InProcessEngine, reference_greedy

pytestmark = pytest.mark.skipif(
    not (EMBEDDED_MODEL_DIR / "config.json").exists(), reason="embedded model not built"
)

MODEL = "default"
EOS = frozenset({1})
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "mood": {"enum": ["happy", "sad"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ("yes", "no", "maybe so", 'a "quoted" | choice')
LARK = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'

CONSTRAINTS = [
    StructuredOutput(choice=CHOICES),
    StructuredOutput(regex=REGEX),
    StructuredOutput(json=json.dumps(SCHEMA), disable_any_whitespace=True),
    StructuredOutput(json=json.dumps(SCHEMA)),
    StructuredOutput(json_object=True),
    StructuredOutput(grammar=LARK),
]


class GrammarReference(LogitsProcessor):
    """transformers' side: llguidance's mask for one sequence, the matcher fed the tokens
    ``generate`` appended since the last call."""

    def __init__(self, grammars: Grammars, spec: StructuredOutput, prompt_len: int) -> None:
        from llguidance import LLMatcher

        self.matcher = LLMatcher(grammars.llg_tokenizer(), grammars.compile(spec))
        self.prompt_len = prompt_len
        self.consumed = 0

    def catch_up(self, input_ids: torch.Tensor) -> None:
        outputs = input_ids[0, self.prompt_len :].tolist()
        for token in outputs[self.consumed :]:
            assert self.matcher.consume_token(token), self.matcher.get_error()
        self.consumed = len(outputs)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.catch_up(input_ids)
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: scores.shape[-1]])
        return scores.masked_fill(~allowed.bool()[None, :], float("-inf"))


class GrammarComplete(StoppingCriteria):
    def __init__(self, reference: GrammarReference) -> None:
        self.reference = reference

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **_: object):
        self.reference.catch_up(input_ids)
        return torch.tensor([self.reference.matcher.is_stopped()])


def reference(
    grammars: Grammars, prompt: list[int], params: SamplingParams, eos: list[int]
) -> list[int]:
    spec = params.structured_output
    processors, options = [], {}
    if spec is not None:
        grammar = GrammarReference(grammars, spec, len(prompt))
        processors.append(grammar)
        options["stopping_criteria"] = StoppingCriteriaList([GrammarComplete(grammar)])
    if params.logit_bias:
        options["sequence_bias"] = {(t,): b for t, b in params.logit_bias}
    return reference_greedy(MODEL, prompt, params.max_new_tokens, eos, processors, **options)


def _workload(rng: random.Random, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    texts = ["Reply in JSON: ", "The code is ", "Answer yes or no. ", "Compute: "]
    cases = []
    for i, spec in enumerate(CONSTRAINTS * 2):
        if i % 2:
            prompt = tokenizer(texts[i % len(texts)])["input_ids"]
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        bias = ((rng.randrange(3, vocab), 3.0),) if i == 3 else ()
        cases.append((prompt, SamplingParams(40, structured_output=spec, logit_bias=bias)))
    for _ in range(6):  # unconstrained requests beside them: greedy, and FULL (a bias)
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))]
        bias = ((rng.randrange(3, vocab), 2.0),) if rng.random() < 0.5 else ()
        cases.append((prompt, SamplingParams(24, logit_bias=bias)))
    return cases


@pytest.fixture(scope="module")
def expected() -> tuple[list[tuple[list[int], SamplingParams]], list[list[int]]]:
    engine = InProcessEngine(MODEL, eos_token_ids=EOS)
    cases = _workload(random.Random(5), engine.vocab_size)
    outputs = [reference(engine.grammars, p, sp, sorted(EOS)) for p, sp in cases]
    return cases, outputs


def _check_text(req: Request, text: str) -> None:
    """A constrained sample that stopped (not cut short) is a whole match of its constraint."""
    spec = req.params.structured_output
    if spec is None or req.status is not RequestStatus.FINISHED_STOPPED:
        return
    if spec.choice is not None:
        assert text in spec.choice
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.grammar is not None:
        assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", text), text
    else:
        value = json.loads(text)
        assert isinstance(value, dict)
        if spec.json is not None:
            assert set(value) == {"name", "age", "mood"} and value["mood"] in ("happy", "sad")
            assert isinstance(value["age"], int) and isinstance(value["name"], str)


@pytest.mark.parametrize("mode", ["sync", "async", "random"])
def test_constrained_greedy_equals_generate_with_the_grammars_mask(mode: str, expected) -> None:
    cases, outputs = expected
    engine = InProcessEngine(MODEL, eos_token_ids=EOS, max_num_seqs=8, max_batch_tokens=64)
    reqs = [engine.add(prompt, params) for prompt, params in cases]
    engine.run(mode=mode, rng=random.Random(7))
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    for req, output in zip(reqs, outputs, strict=True):
        assert req.output_token_ids == output, req.params.structured_output
        _check_text(req, tokenizer.decode(req.output_token_ids, skip_special_tokens=True))
    constrained = [r for r in reqs if r.params.structured_output is not None]
    complete = [r for r in constrained if r.status is RequestStatus.FINISHED_STOPPED]
    assert len(complete) >= len(constrained) // 2, "too few constraints ran to their end"
    assert engine.blocks.num_free_blocks == engine.num_blocks


def test_a_constrained_request_never_carries_a_token_over() -> None:
    """Its mask needs its last token, so in an asynchronous pipeline its rows are planned only
    once that token is back (never carried over), while an unconstrained request beside it
    carries its tokens over from step to step."""
    engine = InProcessEngine(MODEL, eos_token_ids=EOS)
    constrained = engine.add([5, 6, 7], SamplingParams(12, structured_output=CONSTRAINTS[1]))
    free = engine.add([5, 6, 7], SamplingParams(12, ignore_eos=True))
    carried: dict[int, int] = {constrained.request_id: 0, free.request_id: 0}
    masks: list[int] = []
    pack = engine.packer.pack

    def recording_pack(plan, slot, previous):  # type: ignore[no-untyped-def]
        for seq in plan.seqs:
            carried[seq.req.request_id] += seq.carry_src is not None
            if seq.req is constrained:
                assert seq.req.num_pending_tokens == int(seq.samples)  # this step's only
        step = pack(plan, slot, previous)
        masks.append(step.num_token_masks)
        assert step.num_token_masks == sum(s.samples for s in plan.seqs if s.req is constrained)
        return step

    engine.packer.pack = recording_pack  # type: ignore[method-assign]
    engine.run(mode="async")
    assert carried[constrained.request_id] == 0
    assert carried[free.request_id] >= 6
    assert sum(masks) == len(constrained.output_token_ids) > 3
    assert 0 in masks  # steps went on without it while its token was in flight


def test_preempted_constrained_requests_resume_where_their_grammar_was(expected) -> None:
    """A cache too small for the batch: constrained requests are preempted and recomputed,
    their grammars untouched, and their tokens are still ``generate``'s."""
    cases, outputs = expected
    engine = InProcessEngine(
        MODEL, eos_token_ids=EOS, num_blocks=14, max_num_seqs=8, max_batch_tokens=64
    )
    reqs = [engine.add(prompt, params) for prompt, params in cases]
    engine.run(mode="async")
    assert engine.scheduler.num_preemptions > 0
    for req, output in zip(reqs, outputs, strict=True):
        assert req.output_token_ids == output


def test_sampled_constrained_requests_keep_to_their_constraints_in_every_mode() -> None:
    """Seeded sampling under a mask (temperature, top-p, top-k): the same tokens in sync and
    async mode, and every sample that ends is a whole match of its constraint."""
    specs = [CONSTRAINTS[0], CONSTRAINTS[1], CONSTRAINTS[2], CONSTRAINTS[5]]
    params = [
        SamplingParams(40, temperature=t, top_p=0.95, top_k=k, seed=seed, structured_output=spec)
        for spec in specs
        for seed, t, k in ((1, 0.7, 0), (2, 1.0, 50), (3, 1.5, 0))
    ]
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    runs = []
    for mode in ("sync", "async"):
        engine = InProcessEngine(MODEL, eos_token_ids=EOS, max_num_seqs=6, max_batch_tokens=48)
        reqs = [engine.add([5 + i, 9, 11], sp) for i, sp in enumerate(params)]
        engine.run(mode=mode)
        for req in reqs:
            _check_text(req, tokenizer.decode(req.output_token_ids, skip_special_tokens=True))
        runs.append([r.output_token_ids for r in reqs])
        assert sum(r.status is RequestStatus.FINISHED_STOPPED for r in reqs) >= len(reqs) // 2
    assert runs[0] == runs[1]
