"""Every message that crosses a process boundary, and its msgpack encoding.

A frame is a msgpack map ``{"v": PROTOCOL_VERSION, "type": <name>, **fields}``. Decoding is
strict: an unknown type, a missing or unknown field, or a field of the wrong type raises
``ProtocolError`` with a message that names the problem, so a receiver can answer it instead
of crashing. Payload arrays never travel here: they live in the shared-memory slots.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

import msgpack

from cbpipe.protocol.sampling import SamplingParams, safe_repr

PROTOCOL_VERSION = 2

# A prompt of the longest model we serve is well under this; anything bigger is refused
# before it is even unpacked.
MAX_FRAME_BYTES = 8 * 1024 * 1024


class ProtocolError(ValueError):
    """A frame that cannot be decoded or does not match its message type."""


class ErrorKind(enum.StrEnum):
    REQUEST = "request"  # the request was invalid; nothing else is affected
    BUSY = "busy"  # the engine's queue is full: the request may succeed later
    ENGINE = "engine"  # the engine failed or is gone


FinishReasonName = Literal["stop", "length", "cancelled", "error"]


class SamplingMode(enum.StrEnum):
    """Which sampler a step needs: the cheapest that serves every sequence in it."""

    GREEDY = "greedy"  # argmax of the model's logits, for every sequence
    RANDOM = "random"  # temperature only (greedy rows where it is 0)
    FULL = "full"  # penalties, logit bias, min_p, top-k, top-p and top alternatives


class TokenEnd(enum.IntEnum):
    """How an entry of ``Tokens`` leaves its sample."""

    MORE = 0  # more tokens follow
    LAST = 1  # its last token is the sample's last (a length limit, say)
    # Its last token is the sample's last, an EOS or stop token id: a token whose text is
    # left out of the sample's (unless include_stop_str_in_output), as vLLM leaves it out.
    STOP_TOKEN = 2


class Message:
    """Base of all message types; ``TYPE`` is the wire name."""

    TYPE: ClassVar[str]


# --- client <-> scheduler -------------------------------------------------------------------


@dataclass(frozen=True)
class Hello(Message):
    """Client -> scheduler: first message of a connection; answered with ``Welcome``."""

    TYPE: ClassVar[str] = "hello"


@dataclass(frozen=True)
class Welcome(Message):
    """Scheduler -> client: what the engine serves."""

    TYPE: ClassVar[str] = "welcome"
    model: str
    vocab_size: int
    max_model_len: int
    has_tokenizer: bool
    max_frame_bytes: int = MAX_FRAME_BYTES  # larger frames are refused, and cost the connection


@dataclass(frozen=True)
class Submit(Message):
    """Client -> scheduler: one generation job. ``request_id`` is unique per client."""

    TYPE: ClassVar[str] = "submit"
    request_id: int
    prompt: str | list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Cancel(Message):
    """Client -> scheduler: stop the job, or only its sample ``index`` (a client that makes
    the text itself stops a sample whose stop string it found). Each stopped sample gets a
    ``Finished`` of ``"cancelled"``; a sample's cancel applies once the job has started."""

    TYPE: ClassVar[str] = "cancel"
    request_id: int
    index: int | None = None  # None: every sample of the job


@dataclass(frozen=True)
class Goodbye(Message):
    """Client -> scheduler: the client is closing; its unfinished jobs are cancelled.

    A client that dies without saying goodbye leaves its jobs to run to their limits.
    """

    TYPE: ClassVar[str] = "goodbye"


@dataclass(frozen=True)
class Tokens(Message):
    """Scheduler -> client: what the client's jobs produced in one step, one frame per step.

    Columns, one entry per job that moved (``request_ids[i]``, sample ``indices[i]``):
    ``token_ids[i]`` continues that sample's output. The optional columns are present when
    any job in the frame asked for them, with empty entries for jobs that did not:
    ``texts[i]`` is the text those tokens add (held back while a stop string might still
    match, so it never has to be retracted), ``logprobs[i][t]`` the log-probability of token
    ``t`` and ``top_ids[i][t]`` / ``top_logprobs[i][t]`` its most likely alternatives.
    ``ends[i]`` (a ``TokenEnd``; the column is present when any entry ends its sample) says
    whether the entry's last token is its sample's last, and if it is an EOS or stop token:
    what a client that makes the text itself needs to stream it as the engine would.
    """

    TYPE: ClassVar[str] = "tokens"
    request_ids: list[int]
    token_ids: list[list[int]]
    indices: list[int] | None = None  # None: every entry is sample 0
    texts: list[str] | None = None
    logprobs: list[list[float]] | None = None
    top_ids: list[list[list[int]]] | None = None
    top_logprobs: list[list[list[float]]] | None = None
    ends: list[int] | None = None  # TokenEnd values; None: no entry ends its sample

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        columns = ("token_ids", "indices", "texts", "logprobs", "top_ids", "top_logprobs", "ends")
        for name in columns:
            column = getattr(self, name)
            if column is not None and len(column) != n:
                raise ValueError(f"tokens: {name} and request_ids differ in length")


@dataclass(frozen=True)
class PromptLogprobs(Message):
    """Scheduler -> client: the log-probability of every prompt token after the first, given
    the tokens before it (``logprobs[i]`` is prompt token ``i + 1``'s), and the most likely
    alternatives at each position; sent once, before the job's first ``Tokens``."""

    TYPE: ClassVar[str] = "prompt_logprobs"
    request_id: int
    prompt_token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass(frozen=True)
class Finished(Message):
    """Scheduler -> client: one sample of the job is over; its tokens were sent before in
    ``Tokens``. A job of ``n`` samples gets ``n`` of these."""

    TYPE: ClassVar[str] = "finished"
    request_id: int
    finish_reason: FinishReasonName
    text: str | None
    num_prompt_tokens: int
    index: int = 0
    # What stopped it: the stop string matched, or the stop or EOS token id; None otherwise.
    stop_reason: str | int | None = None
    # Seconds from arrival until the scheduler first planned a step for it.
    queue_time_s: float = 0.0
    # Prompt tokens the prefix cache served (not computed for this sample).
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class Error(Message):
    """An error reply. ``request_id`` is None when the frame could not be attributed."""

    TYPE: ClassVar[str] = "error"
    request_id: int | None
    kind: ErrorKind
    message: str


@dataclass(frozen=True)
class GetStats(Message):
    """Client -> scheduler: ask for the engine's counters; answered with ``Stats``."""

    TYPE: ClassVar[str] = "get_stats"


@dataclass(frozen=True)
class Stats(Message):
    """Scheduler -> client: the engine's state and its counters since start."""

    TYPE: ClassVar[str] = "stats"
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # share of KV blocks held by requests, in [0, 1]
    num_prompt_tokens: int  # prompt tokens of requests admitted, counted once each
    num_generation_tokens: int
    num_preemptions: int
    num_steps: int
    # Prefix caching: prompt tokens looked up, and those found cached (not computed).
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0


# --- scheduler <-> worker -------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerReady(Message):
    """Worker -> scheduler handshake: what the worker loaded and could allocate. Every rank
    of a tensor-parallel worker sends its own; the scheduler serves once it has all."""

    TYPE: ClassVar[str] = "worker_ready"
    model: str
    vocab_size: int
    num_blocks: int
    max_batch_tokens: int  # the per-step token budget, chosen by the device (config.py)
    max_num_seqs: int  # the most sequences a step holds, chosen likewise
    dtype: str
    device: str
    eos_token_ids: list[int]
    rank: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class Step(Message):
    """Scheduler -> worker: run the batch packed in ``slot`` as step number ``step``.

    The sizes repeat what the slot header holds, so the worker can check the slot is the one
    the scheduler meant, and can size device views without reading device memory.
    """

    TYPE: ClassVar[str] = "step"
    step: int
    slot: int
    num_tokens: int
    num_seqs: int
    num_single_token_seqs: int  # seqs [0, n) have one query token each; they come first
    max_query_len: int
    max_context_len: int
    block_table_width: int
    # Index of the slot whose sampled ids carry over into this step; None when no row does.
    carry_from_slot: int | None
    sampling: SamplingMode
    # Copy back the top alternatives (``StepOutputs.top_*``) and the prompt log-probabilities.
    top_logprobs: bool
    prompt_logprobs: bool
    num_bias_entries: int  # logit-bias entries in the slot's extras, applied before sampling
    # Structured output's token masks in the slot's extras, applied before the bias entries.
    num_token_masks: int = 0

    @property
    def is_decode_only(self) -> bool:
        """Every sequence has one query token: the decode graphs' steps; the others are
        prefill chunks, alone or beside decodes."""
        return self.num_single_token_seqs == self.num_seqs


@dataclass(frozen=True)
class StepDone(Message):
    """Worker -> scheduler: the step's sampled ids are in its slot's output area."""

    TYPE: ClassVar[str] = "step_done"
    step: int
    slot: int
    # Host clock (time.perf_counter_ns, shared by the processes of one host): when the
    # worker received the step, and the step's compute span on the device (CUDA events
    # mapped onto the host clock; wall time on the CPU).
    recv_ns: int
    device_start_ns: int
    device_end_ns: int
    # When the worker had enqueued the step, and when it saw the outputs in shared memory
    # and reported them (host clock): the worker's share of a step's round trip.
    launched_ns: int = 0
    reported_ns: int = 0

    @property
    def device_ms(self) -> float:
        return (self.device_end_ns - self.device_start_ns) / 1e6


@dataclass(frozen=True)
class Shutdown(Message):
    TYPE: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class WorkerFailed(Message):
    """Worker -> scheduler: the worker hit an error it cannot recover from."""

    TYPE: ClassVar[str] = "worker_failed"
    message: str


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Welcome,
        Submit,
        Cancel,
        Goodbye,
        Tokens,
        PromptLogprobs,
        Finished,
        Error,
        GetStats,
        Stats,
        WorkerReady,
        Step,
        StepDone,
        Shutdown,
        WorkerFailed,
    )
}


# What a client may receive from the scheduler.
REPLY_TYPES: tuple[type[Message], ...] = (
    Welcome,
    Tokens,
    PromptLogprobs,
    Finished,
    Error,
    Stats,
)


def encode(message: Message) -> bytes:
    frame: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": message.TYPE}
    for name in _field_names(type(message)):
        frame[name] = _to_wire(getattr(message, name))
    return msgpack.packb(frame)


def decode(frame: bytes, expected: tuple[type[Message], ...] | None = None) -> Message:
    """Decode and validate one frame; ``expected`` limits which types are accepted here."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"a frame must be a map, got {type(raw).__name__}")
    version = raw.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {safe_repr(version)}, expected {PROTOCOL_VERSION}"
        )
    type_name = raw.pop("type", None)
    cls = MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None or (expected is not None and cls not in expected):
        raise ProtocolError(f"unknown or unexpected message type {safe_repr(type_name)}")
    return _builder(cls)(raw, type_name)


def request_id_of(frame: bytes) -> int | None:
    """Best-effort ``request_id`` of a frame that failed to decode, to address the error."""
    try:
        raw = msgpack.unpackb(frame, raw=False)
    except Exception:
        return None
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else None


# Values msgpack packs as they are; checked first, since nearly every field is one.
_PLAIN_TYPES = frozenset({int, float, str, bool, bytes, list, type(None)})


def _to_wire(value: Any) -> Any:
    if type(value) in _PLAIN_TYPES:
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: _to_wire(getattr(value, name)) for name in _field_names(type(value))}
    return value


# Decoding checks every field against its declared type. The hints are read once per type
# and turned into a converter, a function of (value, where) that returns the value as the
# field holds it or raises ProtocolError naming ``where``: a frame arrives for every submit
# and every step, and walking the hints for each of them cost more than the rest of a
# submit's handling together (docs/PERFORMANCE.md).
Converter = Callable[[Any, str], Any]


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_BUILDERS: dict[type, Converter] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _builder(cls: type) -> Converter:
    build = _BUILDERS.get(cls)
    if build is None:
        build = _BUILDERS[cls] = _new_builder(cls)
    return build


def _new_builder(cls: type) -> Converter:
    """The converter of a frame's (or a nested map's) fields into an instance of ``cls``."""
    hints = {k: v for k, v in typing.get_type_hints(cls).items() if get_origin(v) is not ClassVar}
    fields = [
        (
            f.name,
            _converter(hints[f.name]),
            _kept_as_is(hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    ]
    names = frozenset(name for name, _, _, _ in fields)

    def build(raw: dict[str, Any], context: str) -> Any:
        if not names.issuperset(raw):
            unknown = sorted(set(raw) - names, key=str)
            raise ProtocolError(f"{context}: unknown field(s) {', '.join(map(repr, unknown))}")
        values = {}
        for name, convert, kept, required in fields:
            if name in raw:
                value = raw[name]
                values[name] = value if type(value) in kept else convert(value, f"{context}.{name}")
            elif required:
                raise ProtocolError(f"{context}: missing field {name!r}")
        try:
            return cls(**values)
        except ValueError as exc:  # a message's own consistency check
            raise ProtocolError(str(exc)) from None

    return build


def _kept_as_is(hint: Any) -> frozenset[type]:
    """The wire types that ``_converter(hint)`` returns unchanged after a type check alone:
    most fields of most frames, which skip the converter's call."""
    if get_origin(hint) in (Union, types.UnionType):
        return frozenset().union(*(_kept_as_is(option) for option in get_args(hint)))
    if hint in (type(None), bool, int, float, str):
        return frozenset({hint})
    return frozenset()


def _expected(hint: Any, value: Any, where: str) -> ProtocolError:
    return ProtocolError(f"{where}: expected {_hint_name(hint)}, got {_describe(value)}")


@functools.cache
def _converter(hint: Any) -> Converter:  # noqa: C901 - one case per type form
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return _union_converter(hint)
    if hint is type(None):

        def convert_none(value: Any, where: str) -> Any:
            if value is None:
                return None
            raise _expected(hint, value, where)

        return convert_none
    if origin is Literal:
        allowed = get_args(hint)

        def convert_literal(value: Any, where: str) -> Any:
            if value in allowed:
                return value
            raise ProtocolError(f"{where}: must be one of {allowed}, got {safe_repr(value)}")

        return convert_literal
    if origin is tuple and get_args(hint)[-1:] != (Ellipsis,):
        positions = [_converter(a) for a in get_args(hint)]  # a fixed-length tuple

        def convert_fixed_tuple(value: Any, where: str) -> Any:
            if isinstance(value, list) and len(value) == len(positions):
                return tuple(
                    convert(v, f"{where}[{i}]")
                    for i, (convert, v) in enumerate(zip(positions, value, strict=True))
                )
            raise _expected(hint, value, where)

        return convert_fixed_tuple
    if origin in (list, tuple):
        return _sequence_converter(hint, origin)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):

        def convert_enum(value: Any, where: str) -> Any:
            try:
                return hint(value)
            except ValueError:
                raise ProtocolError(f"{where}: invalid value {safe_repr(value)}") from None

        return convert_enum
    if dataclasses.is_dataclass(hint):

        def convert_map(value: Any, where: str) -> Any:
            if isinstance(value, dict):
                return _builder(hint)(value, where)  # type: ignore[arg-type]
            raise _expected(hint, value, where)

        return convert_map
    if hint is float:

        def convert_float(value: Any, where: str) -> Any:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            raise _expected(hint, value, where)

        return convert_float
    if hint in (bool, int, str):
        # Exact types: msgpack gives bool for booleans only, and a bool is no int here.
        def convert_exact(value: Any, where: str) -> Any:
            if type(value) is hint:
                return value
            raise _expected(hint, value, where)

        return convert_exact
    raise TypeError(f"unsupported field type {hint!r}")  # a message declared a type we lack


def _union_converter(hint: Any) -> Converter:
    options = [(_shape_of(option), _converter(option)) for option in get_args(hint)]
    names = " or ".join(_hint_name(option) for option in get_args(hint))

    def convert_union(value: Any, where: str) -> Any:
        # The options whose outer shape fits first: a failed try formats its error message,
        # and most values (an unset optional, a prompt of token ids) fit one option at once.
        fitting = [shape is None or isinstance(value, shape) for shape, _ in options]
        for fits in (True, False):
            for (_, convert), fit in zip(options, fitting, strict=True):
                if fit is fits:
                    try:
                        return convert(value, where)
                    except ProtocolError:
                        continue
        raise ProtocolError(f"{where}: expected {names}, got {_describe(value)}")

    return convert_union


def _sequence_converter(hint: Any, origin: type) -> Converter:
    (item,) = get_args(hint)[:1]
    as_tuple = origin is tuple
    fits: Callable[[list[Any]], bool] | None = None
    # Prompts, token lists and log-probabilities: their elements' types checked in one pass
    # in C (``map``), not one converter call each; a bad element is named by the per-element
    # pass below.
    if item in (int, float):
        only = frozenset({item})
        fits = lambda value: set(map(type, value)) <= only  # noqa: E731
    elif item == list[int]:
        lists, ints = frozenset({list}), frozenset({int})
        fits = lambda value: (  # noqa: E731
            set(map(type, value)) <= lists
            and set(map(type, itertools.chain.from_iterable(value))) <= ints
        )
    convert_item = _converter(item)

    def convert_sequence(value: Any, where: str) -> Any:
        if not isinstance(value, list):
            raise _expected(hint, value, where)
        if fits is not None and fits(value):
            return tuple(value) if as_tuple else value
        items = [convert_item(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if as_tuple else items

    return convert_sequence


def _shape_of(hint: Any) -> type | tuple[type, ...] | None:
    """The outer type(s) a value of ``hint`` has on the wire (its items unchecked), or None
    where every value is worth a try (a Literal or an enum)."""
    if hint is type(None):
        return type(None)
    if get_origin(hint) in (list, tuple):
        return list
    if dataclasses.is_dataclass(hint):
        return dict
    if hint is float:
        return (int, float)
    if isinstance(hint, type) and not issubclass(hint, enum.Enum):
        return hint
    return None


def _hint_name(hint: Any) -> str:
    if hint is type(None):
        return "None"
    if get_origin(hint) is tuple and get_args(hint)[-1:] != (Ellipsis,):
        return f"[{', '.join(_hint_name(a) for a in get_args(hint))}]"
    if get_origin(hint) in (list, tuple):
        return f"list of {_hint_name(get_args(hint)[0])}"
    return getattr(hint, "__name__", None) or str(hint)


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {safe_repr(value)}"
