"""Structured output: a request's constraint as a grammar, followed token by token, and the
token masks of the steps in which it samples.

llguidance does the matching. ``Grammars`` turns a ``StructuredOutput`` into llguidance's
grammar text and checks it once per job; each sample follows its outputs with a
``TokenGrammar`` of its own; ``fill_masks`` writes the masks of a step's samplers straight
into the slot (``StepExtras.token_masks``, llguidance's bit layout), on llguidance's threads.

Why a constrained request never carries a token over: its mask for step N+1 depends on the
token step N samples, which the scheduler learns only after it has packed N+1 (and N+2, with
three steps in flight). So it samples in one step of every ``--steps-in-flight`` while the
pipeline is full (``core.Scheduler``), with its mask computed from every token it has, while
the requests beside it keep the overlap.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from cbpipe.protocol.sampling import StructuredOutput

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger(__name__)


# What may come between JSON's tokens unless a request disables whitespace: nothing, one
# space, or a line break and an indentation, as llama.cpp's JSON grammar has it. Unbounded
# whitespace (vLLM's default) lets a model that has lost its way write spaces or blank
# lines until its length limit, the best-known failure of constrained JSON; this keeps
# compact, spaced and pretty-printed JSON, ten levels deep at four spaces.
JSON_WHITESPACE = r"(?:\r?\n[ \t]{0,40}| )?"


class StructuredOutputUnavailable(ValueError):
    """The engine cannot constrain this model's outputs (no tokenizer, no llguidance)."""


class Grammars:
    """Compiles constraints for one model's tokenizer. llguidance's view of the tokenizer
    (every token's bytes) is built by ``llg_tokenizer``: the scheduler calls it at start-up
    (``process._load_text_tools``); tests and benchmarks leave it to the first constraint."""

    def __init__(self, tokenizer: Any | None, vocab_size: int, eos_token_ids: Iterable[int]):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    def compile(self, spec: StructuredOutput) -> str:
        """llguidance's grammar for ``spec``; ``ValueError`` naming what is wrong with it."""
        tokenizer = self.llg_tokenizer()
        from llguidance import LLMatcher

        grammar = _grammar_text(spec)
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(f"invalid structured_output.{spec.kind}: {error.strip()}")
        return grammar

    def start(self, spec: StructuredOutput) -> TokenGrammar:
        """A matcher at the start of ``spec``'s grammar, tried first on a copy: its first mask
        computed and one token it allows taken. llguidance builds its lexer lazily, and a
        constraint too complex for it (a regular expression of a million states, say) fails
        there, which must be a refusal now, on the preparation thread, and not a sample's
        end on the step loop (a constraint that fails later still ends its sample as an
        error, ``Request.accept_sampled``)."""
        first = self.follow(self.compile(spec))
        trial = first.copy()
        bits = np.frombuffer(trial.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little"))
        if len(allowed) and not trial.failed:
            trial.accept(int(allowed[0]))
        if trial.failed:
            error = trial.error.strip().splitlines()[0]
            raise ValueError(f"structured_output.{spec.kind} is too complex to follow: {error}")
        return first

    def follow(self, grammar: str) -> TokenGrammar:
        """A matcher at the start of ``grammar`` (from ``compile``), for one sample."""
        from llguidance import LLMatcher

        tokenizer = self.llg_tokenizer()
        assert self._executor is not None  # built with the tokenizer
        return TokenGrammar(LLMatcher(tokenizer, grammar, log_level=0), self._executor)

    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is not None:
            return self._tokenizer
        if self._hf_tokenizer is None:
            raise StructuredOutputUnavailable(
                "structured output needs the model's tokenizer, and this model has none"
            )
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            raise StructuredOutputUnavailable(
                "structured output needs the llguidance package: pip install llguidance"
            ) from None
        started = time.perf_counter()
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None
            )
        except Exception as exc:  # a tokenizer llguidance cannot read: say so, once per job
            raise StructuredOutputUnavailable(
                f"structured output cannot read this model's tokenizer: {exc}"
            ) from None
        self._executor = llguidance.LLExecutor()
        log.info(
            "structured output: read the tokenizer's %d tokens in %.2f s",
            self.vocab_size,
            time.perf_counter() - started,
        )
        return self._tokenizer


class TokenGrammar:
    """One sample's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, executor: llguidance.LLExecutor) -> None:
        self.matcher = matcher
        self.executor = executor  # the threads that compute its masks

    def accept(self, token_id: int) -> bool:
        """Advance past the sample's next output; False if the grammar does not allow it
        (the mask should have made that impossible)."""
        return bool(self.matcher.consume_token(token_id))

    def copy(self) -> TokenGrammar:
        """Another sample's matcher at the same place (cheaper than a new one)."""
        return TokenGrammar(self.matcher.deep_copy(), self.executor)

    @property
    def is_complete(self) -> bool:
        """No token may follow but EOS: the text is a whole match."""
        return bool(self.matcher.is_stopped())

    @property
    def failed(self) -> bool:
        """llguidance gave up on it (a lexer too complex, say): its masks mean nothing."""
        return bool(self.matcher.is_error())

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())


def fill_masks(grammars: Sequence[TokenGrammar], masks: np.ndarray) -> None:
    """Row ``i`` of ``masks`` (``[>= len(grammars), mask_words]`` int32, C-contiguous)
    becomes the mask of ``grammars[i]``'s next token, all of them computed in parallel."""
    from llguidance.numpy import fill_next_token_bitmask_par

    if grammars:
        pairs = [(g.matcher, index) for index, g in enumerate(grammars)]
        fill_next_token_bitmask_par(grammars[0].executor, pairs, masks)


def _grammar_text(spec: StructuredOutput) -> str:
    from llguidance import LLMatcher

    kind = spec.kind
    if kind == "json" or kind == "json_object":
        schema: dict[str, Any] = {"type": "object"}
        if kind == "json":
            assert spec.json is not None
            try:
                schema = json.loads(spec.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_output.json is not JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_output.json must be a JSON schema (an object)")
        options: JsonCompileOptions = (
            {"whitespace_flexible": False}
            if spec.disable_any_whitespace
            else {"whitespace_pattern": JSON_WHITESPACE}
        )
        try:
            return str(LLMatcher.grammar_from_json_schema(schema, defaults=options))
        except ValueError as exc:
            raise ValueError(f"invalid structured_output.json: {exc}") from None
    if kind == "regex":
        assert spec.regex is not None
        return str(LLMatcher.grammar_from_regex(spec.regex))
    if kind == "choice":
        assert spec.choice is not None
        # Lark's string literals take JSON's escapes, so any choice is one literal.
        alternatives = " | ".join(json.dumps(choice) for choice in spec.choice)
        return str(LLMatcher.grammar_from_lark(f"start: {alternatives}"))
    assert spec.grammar is not None
    return str(LLMatcher.grammar_from_lark(spec.grammar))
