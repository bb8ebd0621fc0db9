"""Per-request sampling parameters: one definition, validated on both sides of the socket.

Every bound here is what the engine can carry: integers that travel in the shared-memory
slots must fit their int32 fields, floats must survive the float32 the device computes in,
and lists are bounded so that one request's share of a slot is bounded too.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from dataclasses import dataclass, field

import numpy as np

MAX_SEED = 2**63 - 1
INT32_MAX = 2**31 - 1
# Alternatives returned per token (OpenAI's chat API allows 20; its completions API 5).
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries per request
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_SAMPLES = 128  # n
MAX_CACHE_SALT_CHARS = 256
# A structured-output spec (a JSON schema, a regex, a grammar, the choices together): tool
# definitions make schemas of tens of kilobytes; a bound keeps one request's compile bounded.
MAX_STRUCTURED_CHARS = 256 * 1024
MAX_CHOICES = 1024
MAX_TEMPERATURE = 1e4  # far above any useful value, and its reciprocal is a normal float32
# OpenAI's range for logit_bias values; -100 bans a token in practice, as it does there.
LOGIT_BIAS_RANGE = (-100.0, 100.0)
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency, as OpenAI bounds them
REPETITION_PENALTY_MAX = 100.0
# The smallest top_p and min_p whose float32 value is a usable threshold: below the smallest
# normal float32 the value flushes towards 0, and a top_p of 0 would mask every token.
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 40, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def safe_repr(value: object) -> str:
    """A short ``repr`` of untrusted data: bounded in depth and length, so neither a frame
    nested a thousand deep nor a megabyte string can make an error message fail or grow."""
    return _REPR.repr(value)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a sample's text, as vLLM's ``structured_outputs`` has it: exactly one
    of a JSON schema (``json``, as JSON text), any JSON object (``json_object``), a regular
    expression, a list of choices, or a Lark grammar (llguidance's dialect). The device masks
    every token that would leave the constraint, so the text always matches it or is a prefix
    of a match (a sample cut short by its length limit)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # JSON without whitespace between its tokens; by default a space, or a line break and an
    # indentation, may come there, as models trained on pretty-printed JSON write it.
    disable_any_whitespace: bool = False

    @property
    def kind(self) -> str:
        """Which constraint it is: ``json``, ``json_object``, ``regex``, ``choice`` or
        ``grammar``."""
        if self.json_object:
            return "json_object"
        names = ("json", "regex", "choice", "grammar")
        return next(name for name in names if getattr(self, name) is not None)

    def validate(self) -> None:
        _check_bool("structured_output.json_object", self.json_object)
        _check_bool("structured_output.disable_any_whitespace", self.disable_any_whitespace)
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "structured_output takes exactly one of json, json_object, regex, choice and "
                f"grammar; got {', '.join(given) or 'none'}"
            )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_output.{name} must be a non-empty string")
            if len(value) > MAX_STRUCTURED_CHARS:
                raise ValueError(
                    f"structured_output.{name} holds {len(value)} characters; at most "
                    f"{MAX_STRUCTURED_CHARS} are allowed"
                )
        if self.choice is not None:
            _check_sequence("structured_output.choice", self.choice, MAX_CHOICES)
            if not self.choice:
                raise ValueError("structured_output.choice must hold at least one choice")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_output.choice entries must be non-empty strings")
            if sum(map(len, self.choice)) > MAX_STRUCTURED_CHARS:
                raise ValueError(
                    f"structured_output.choice holds more than {MAX_STRUCTURED_CHARS} characters"
                )


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens, what it reports, and when it stops.

    ``temperature == 0`` is greedy decoding. A request with a ``seed`` draws the same tokens
    whatever else shares its batch: the random number for output token ``i`` of sample ``j``
    depends only on ``(seed, j, i)``.

    Processing order on the device, as vLLM has it: the ``structured_output`` mask, then
    ``logit_bias`` and the ``min_tokens`` ban, then the penalties, then temperature,
    ``min_p``, ``top_k`` and ``top_p``. Log-probabilities (``logprobs``, ``prompt_logprobs``)
    are the model's own distribution, before any of that.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps every token
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_p: float = 0.0
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings, matched in the text
    min_tokens: int = 0  # EOS and stop tokens are banned until this many outputs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Token id -> bias added to its logit. A tuple of pairs, not a dict: frozen and hashable.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    logprobs: int | None = None  # None: none; k: the sampled token's and k alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    n: int = 1  # independent samples of the prompt
    detokenize: bool = True  # stream text beside the token ids (needs the model's tokenizer)
    skip_special_tokens: bool = True  # leave the tokenizer's special tokens out of the text
    # Keep the stop string that ended a sample in its text, and the text of the stop or EOS
    # token that ended it (vLLM's; by default both are left out).
    include_stop_str_in_output: bool = False
    # Requests share cached prompt blocks only with requests of the same salt: a client that
    # passes its own keeps its prompts' cache to itself.
    cache_salt: str | None = None
    structured_output: StructuredOutput | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first parameter that is out of range."""
        _check_int("max_new_tokens", self.max_new_tokens, low=1, high=INT32_MAX)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, low=_FLOAT32_TINY, high=1.0)
        _check_int("top_k", self.top_k, low=0, high=INT32_MAX)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if 0.0 < self.min_p < _FLOAT32_TINY:
            raise ValueError(f"min_p must be 0 or at least {_FLOAT32_TINY:.3g}, got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        _check_sequence("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids entry", token_id, low=0, high=INT32_MAX)
        _check_sequence("stop", self.stop, MAX_STOP_STRINGS)
        for text in self.stop:
            if not isinstance(text, str) or not 0 < len(text) <= MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"each stop string must be a non-empty string of at most "
                    f"{MAX_STOP_STRING_CHARS} characters, got {safe_repr(text)}"
                )
        _check_bool("ignore_eos", self.ignore_eos)
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_new_tokens)
        _check_float("presence_penalty", self.presence_penalty, *PENALTY_RANGE)
        _check_float("frequency_penalty", self.frequency_penalty, *PENALTY_RANGE)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, REPETITION_PENALTY_MAX)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_sequence("logit_bias", self.logit_bias, MAX_LOGIT_BIAS)
        seen: set[int] = set()
        for entry in self.logit_bias:
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise ValueError("logit_bias entries must be (token_id, bias) pairs")
            token_id, bias = entry
            _check_int("logit_bias token id", token_id, low=0, high=INT32_MAX)
            _check_float(f"logit_bias[{token_id}]", bias, *LOGIT_BIAS_RANGE)
            if token_id in seen:
                raise ValueError(f"logit_bias names token id {token_id} twice")
            seen.add(token_id)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, low=0, high=MAX_TOP_LOGPROBS)
        _check_int("n", self.n, low=1, high=MAX_SAMPLES)
        _check_bool("detokenize", self.detokenize)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT_CHARS
        ):
            raise ValueError(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are matched in the text: they need detokenize")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise ValueError("structured_output must be a StructuredOutput")
            self.structured_output.validate()

    def without_text(self) -> SamplingParams:
        """These parameters as the engine gets them from a client that makes the text itself:
        token ids only, the stop strings matched by the client."""
        if not self.detokenize:
            return self
        return dataclasses.replace(self, detokenize=False, stop=())

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def needs_full_sampling(self) -> bool:
        """Whether the device needs more than the plain greedy or temperature sampler."""
        return (
            self.top_k > 0
            or self.top_p < 1.0
            or self.min_p > 0.0
            or self.min_tokens > 0
            or bool(self.logit_bias)
            or self.has_penalties
            or bool(self.logprobs)  # top alternatives; the sampled token's own is always there
            or self.structured_output is not None  # its token mask is a row of the bias
        )


def _check_int(name: str, value: object, *, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{name} must be an integer, got {type(value).__name__} {safe_repr(value)}"
        )
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _check_float(name: str, value: object, low: float, high: float) -> None:
    """A finite number in ``[low, high]``; a float32 representation of it is what the device
    sees, and anything in range survives that (the bounds are far inside float32's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {safe_repr(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__}")


def _check_sequence(name: str, value: object, max_len: int) -> None:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {type(value).__name__}")
    if len(value) > max_len:
        raise ValueError(f"{name} holds {len(value)} entries; at most {max_len} are allowed")
