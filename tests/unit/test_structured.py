"""Structured output's grammars (llguidance) on the embedded model's tokenizer: what each
constraint allows, what is refused and why, and when llguidance's view of the tokenizer is
built."""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import pytest

from cbpipe.models import EMBEDDED_MODEL_DIR, resolve_model
from cbpipe.protocol.sampling import StructuredOutput
from cbpipe.scheduler.process import _load_text_tools
from cbpipe.scheduler.structured import Grammars, TokenGrammar, fill_masks

pytestmark = pytest.mark.skipif(
    not (EMBEDDED_MODEL_DIR / "config.json").exists(), reason="embedded model not built"
)
VOCAB = 2048
EOS = 1


@cache
def grammars() -> Grammars:
    from transformers import AutoTokenizer

    return Grammars(AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR), VOCAB, [EOS])


def follow(spec: StructuredOutput) -> TokenGrammar:
    return grammars().follow(grammars().compile(spec))


def feed(grammar: TokenGrammar, text: str) -> bool:
    """Whether the grammar takes ``text``'s tokens, one by one."""
    tokenizer = grammars()._hf_tokenizer
    return all(grammar.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))


def allowed(grammar: TokenGrammar) -> set[int]:
    masks = np.zeros((1, VOCAB // 32), np.int32)
    fill_masks([grammar], masks)
    return set(np.flatnonzero(np.unpackbits(masks.view(np.uint8), bitorder="little")).tolist())


def test_a_choice_is_one_literal_whatever_its_characters() -> None:
    spec = StructuredOutput(choice=('say "hi" | bye', "a\\b"))
    assert feed(grammar := follow(spec), 'say "hi" | bye') and grammar.is_complete
    assert feed(grammar := follow(spec), "a\\b") and grammar.is_complete
    assert feed(grammar := follow(spec), "say") and not grammar.is_complete  # a prefix
    assert not feed(follow(spec), "nope")


def test_json_whitespace_is_bounded_unless_disabled() -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    pretty = '{\n    "a": 1\n}'
    assert feed(follow(StructuredOutput(json=schema)), pretty)
    assert feed(follow(StructuredOutput(json=schema)), '{ "a" : 1 }')
    assert not feed(follow(StructuredOutput(json=schema)), '{"a":' + " " * 60 + "1}")
    assert not feed(follow(StructuredOutput(json=schema)), '{\n\n\n"a": 1}')
    compact = StructuredOutput(json=schema, disable_any_whitespace=True)
    assert feed(grammar := follow(compact), '{"a":1}')
    assert not feed(follow(compact), '{"a": 1}')
    assert allowed(grammar) == {EOS}  # a whole value: only EOS may follow


def test_a_copy_walks_on_its_own() -> None:
    first = follow(StructuredOutput(regex="[0-9]{3}"))
    assert feed(first, "12")
    second = first.copy()
    assert feed(first, "3") and first.is_complete
    assert not second.is_complete and feed(second, "4") and second.is_complete


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput(regex="a(b"), "(?s)invalid structured_output.regex: .*unclosed group"),
        (StructuredOutput(json="{"), "structured_output.json is not JSON"),
        (StructuredOutput(json="[1]"), "must be a JSON schema"),
        (StructuredOutput(json='{"type": "nosuch"}'), "invalid structured_output.json"),
        (StructuredOutput(grammar="start: missing"), "invalid structured_output.grammar"),
    ],
)
def test_a_constraint_that_does_not_compile_says_why(spec: StructuredOutput, message: str):
    with pytest.raises(ValueError, match=message):
        grammars().compile(spec)


def test_llguidances_tokenizer_is_built_at_start_up_not_at_the_first_request() -> None:
    tokenizer, built = _load_text_tools(resolve_model("default"), VOCAB)
    assert tokenizer is not None and isinstance(built, Grammars)
    assert built._tokenizer is not None  # built before serving: 2-5 s at 128 k tokens
    _, reason = _load_text_tools(resolve_model("random:qwen2-tiny"), 512)
    assert reason == "the model has no tokenizer: structured output needs one"


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput(regex="(a{1000}){1000}"),
        StructuredOutput(json='{"type": "string", "pattern": "^(a{1000}){1000}$"}'),
        StructuredOutput(grammar="start: /(a{1000}){1000}/"),
    ],
)
def test_a_constraint_too_complex_to_follow_is_refused_before_it_runs(
    spec: StructuredOutput,
) -> None:
    """It compiles, but llguidance's lexer gives up at the first mask: a refusal naming it
    (it was a sample's silent end, an EOS drawn from a mask that meant nothing)."""
    with pytest.raises(ValueError, match="too complex to follow: .*"):
        grammars().start(spec)
    assert not grammars().start(StructuredOutput(regex="a{3}")).failed


def test_a_grammar_that_fails_mid_sample_ends_it_as_an_error() -> None:
    from cbpipe.protocol.sampling import SamplingParams
    from cbpipe.scheduler.request import Request, RequestStatus

    grammar = grammars().start(StructuredOutput(regex="[0-9]+"))
    req = Request(1, [5], SamplingParams(8), 1, 64, frozenset({EOS}), grammar=grammar)
    req.num_pending_tokens = 1
    assert not grammar.accept(7)  # a token its mask would not allow: the matcher fails
    assert grammar.failed
    assert req.accept_sampled(EOS) is RequestStatus.FINISHED_ERROR  # not a "stop"
