"""What both clients share: the request options, the results, a job's state, the
routing of the engine's replies to jobs, and the socket's set-up.

``JobState`` assembles what the engine sends for one job (tokens, text, log-probabilities,
finishes, errors) and ``route_reply`` decides which job a frame is for; neither knows of
threads, asyncio or sockets. ``Client`` feeds them from its I/O thread, ``AsyncClient`` from
its event loop, and each wakes its own waiters (a ``ReplySink``).

A client given the model's tokenizer makes its jobs' text itself, as vLLM's front-end does:
the engine sends token ids only, ``JobState`` decodes them and matches the stop strings (the
same ``detokenizer`` stage the engine would run, so the text is the same), drops what the
engine made after a match, and its owner cancels that sample on the engine. This takes the
text off the engine's one scheduling thread, whose time per step bounds every client's
throughput, and spreads it over the clients (the HTTP server's processes, say).
"""

from __future__ import annotations

import functools
import json
import logging
import numbers
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Protocol, TypedDict

import zmq

from cbpipe import env
from cbpipe.detokenizer import Detokenizer, SampleText
from cbpipe.protocol.liveness import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS
from cbpipe.protocol.messages import (
    REPLY_TYPES,
    Error,
    ErrorKind,
    Finished,
    PromptLogprobs,
    ProtocolError,
    Stats,
    Submit,
    TokenEnd,
    Tokens,
    Welcome,
    decode,
    encode,
)
from cbpipe.protocol.sampling import SamplingParams, StructuredOutput
from cbpipe.protocol.security import CurveKeys, uses_curve

log = logging.getLogger("cbpipe.client")


class RequestError(ValueError):
    """The engine refused the request; the message says why. Other jobs are unaffected."""


class EngineError(RuntimeError):
    """The engine failed, is gone, or never answered."""


class EngineBusy(RuntimeError):
    """The engine's queue was full: the job was refused for now, and may succeed later."""


def error_for(kind: ErrorKind, message: str) -> Exception:
    """The exception a client raises for an ``Error`` of ``kind``."""
    return {
        ErrorKind.REQUEST: RequestError,
        ErrorKind.BUSY: EngineBusy,
        ErrorKind.ENGINE: EngineError,
    }[kind](message)


class SamplingOptions(TypedDict, total=False):
    """The keyword arguments of ``submit`` besides ``max_new_tokens``; ``SamplingParams``
    documents each one."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop_token_ids: Iterable[int]
    stop: str | Iterable[str]
    ignore_eos: bool
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Mapping[int, float] | None
    logprobs: int | None
    prompt_logprobs: int | None
    n: int
    detokenize: bool
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    cache_salt: str | None
    # A StructuredOutput, or a mapping as vLLM's structured_outputs: {"json": schema}, ...
    structured_output: StructuredOutput | Mapping[str, Any] | None


# Replies carry a step's tokens of many jobs: roomy, but bounded.
CLIENT_MAXMSGSIZE = 256 * 1024 * 1024
MONITORED_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)


def configure_client_socket(socket: zmq.Socket, address: str, api_key: str | None) -> None:
    """Options of a client's DEALER socket, before it connects: no queue limits (a job's
    tokens must never be dropped), ZeroMQ heartbeats (an engine process that stops is noticed
    within ``HEARTBEAT_TIMEOUT_MS``), and CURVE with the api key off this host."""
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, CLIENT_MAXMSGSIZE)
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    api_key = api_key or env.api_key()
    if api_key is not None and uses_curve(address, api_key):
        CurveKeys.from_api_key(api_key).make_client(socket)


def connection_error(event: int, address: str, welcomed: bool) -> EngineError | None:
    """What a socket-monitor event means for the client's jobs, if anything."""
    if event == zmq.EVENT_DISCONNECTED and not welcomed:
        return EngineError(
            f"the engine at {address} closed the connection before it answered: an engine "
            "that serves other machines needs the client's api key (api_key=, CBPIPE_API_KEY)"
        )
    if event == zmq.EVENT_DISCONNECTED:
        return EngineError(f"lost the connection to the engine at {address}")
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return EngineError(f"the engine at {address} refused this client's api key")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return EngineError(
            f"the engine at {address} and this client disagree on security: one has an api "
            "key (--api-key, CBPIPE_API_KEY) and the other not"
        )
    return None


def make_params(max_new_tokens: int, options: SamplingOptions) -> SamplingParams:
    """Validated parameters from ``submit``'s arguments; ``RequestError`` names a bad one."""
    values: dict[str, object] = dict(options)
    stop = values.get("stop", ())
    values["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)  # type: ignore[arg-type]
    values["stop_token_ids"] = tuple(values.get("stop_token_ids", ()))  # type: ignore[arg-type]
    bias = values.get("logit_bias") or {}
    if not isinstance(bias, Mapping):
        raise RequestError("logit_bias must map token ids to biases")
    values["logit_bias"] = tuple(bias.items())
    values["structured_output"] = structured_output_of(values.get("structured_output"))
    try:
        params = SamplingParams(max_new_tokens, **values)  # type: ignore[arg-type]
    except TypeError as exc:  # an option this client does not know
        raise RequestError(str(exc)) from None
    try:
        params.validate()
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    return params


_STRUCTURED_FIELDS = tuple(f.name for f in fields(StructuredOutput))


def structured_output_of(given: object) -> StructuredOutput | None:
    """``structured_output=`` as ``submit`` takes it: a ``StructuredOutput``, or a mapping of
    its fields as vLLM's ``structured_outputs`` is written (``{"json": schema}``,
    ``{"choice": ["yes", "no"]}``, ...). A schema may be an object (sent as its JSON text) or
    its text; choices a list. Keys set to None are left out. ``RequestError`` names what
    does not fit; ``validate`` checks the rest."""
    if given is None:
        return None
    if isinstance(given, StructuredOutput):
        values = {name: getattr(given, name) for name in _STRUCTURED_FIELDS}
    elif isinstance(given, Mapping):
        unknown = sorted(set(given) - set(_STRUCTURED_FIELDS), key=str)
        if unknown:
            raise RequestError(
                f"structured_output has no field {', '.join(map(repr, unknown))}; its fields "
                f"are {', '.join(_STRUCTURED_FIELDS)}"
            )
        values = dict(given)
    else:
        raise RequestError(
            "structured_output must be a StructuredOutput or a mapping of its fields, got "
            f"{type(given).__name__}"
        )
    values = {name: value for name, value in values.items() if value is not None}
    schema = values.get("json")
    if schema is not None and not isinstance(schema, str):
        try:
            values["json"] = json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise RequestError(f"structured_output.json is no JSON schema: {exc}") from None
    if isinstance(values.get("choice"), list):
        values["choice"] = tuple(values["choice"])
    return StructuredOutput(**values)


_PYTHON_INT = frozenset({int})


def prompt_payload(prompt: object) -> str | list[int]:
    """A text prompt as is, or token ids as a list of Python ints (from any sequence of
    integers, numpy's and torch's among them, or a one-dimensional array or tensor, as a
    tokenizer returns them); anything else is a ``RequestError``."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and set(map(type, prompt)) <= _PYTHON_INT:
        return list(prompt)  # the common case, checked in C: a per-token ABC check is slow
    if hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1:
        prompt = prompt.tolist()  # an array or tensor: its elements as Python numbers
    if (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, (bytes, bytearray))
        and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt)
    ):
        return [int(t) for t in prompt]
    raise RequestError("a prompt must be a string or a list of integer token ids")


def submit_frame(
    request_id: int,
    prompt: object,
    max_new_tokens: int,
    options: SamplingOptions,
    max_frame_bytes: int,
    *,
    text_here: bool = False,
) -> tuple[SamplingParams, bytes]:
    """The validated parameters and the encoded ``Submit`` of one job; ``RequestError`` for a
    bad parameter or prompt, or a frame over the engine's limit. ``text_here``: the client
    makes the job's text, and the engine is asked for token ids only."""
    params = make_params(max_new_tokens, options)
    wire = params.without_text() if text_here else params
    try:
        frame = encode(Submit(request_id, prompt_payload(prompt), wire))
    except UnicodeEncodeError as exc:  # half of a UTF-16 pair, say: no UTF-8 spells it
        where = _field_holding(exc.object, prompt, params)
        raise RequestError(
            f"{where} holds {exc.object[exc.start : exc.end]!r}, which is not text (an "
            f"unpaired UTF-16 surrogate)"
        ) from None
    if len(frame) > max_frame_bytes:
        raise RequestError(
            f"request of {len(frame)} bytes exceeds the engine's frame limit of "
            f"{max_frame_bytes} bytes"
        )
    return params, frame


def _field_holding(text: object, prompt: object, params: SamplingParams) -> str:
    if text is prompt:
        return "prompt"
    if text == params.cache_salt:
        return "cache_salt"
    return "stop" if text in params.stop else "the request"


TopLogprobs = list[tuple[int, float]]  # (token id, log-probability), most likely first


class Delta(NamedTuple):
    """What one step added to one sample of a job; the last delta of a sample has its
    ``finish_reason`` (and may add no tokens).

    Made for a reader when it asks (``JobState.deltas``), from the job's own lists: the job
    keeps only a few numbers per step (``JobState``).
    """

    # The sample's index shadows tuple.index, which nothing calls on a delta.
    index: int  # type: ignore[assignment]
    token_ids: list[int]
    text: str  # "" when the job is not detokenized, or while a stop string may still match
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # with the finish: the stop string or token id


@dataclass(frozen=True)
class PromptLogprob:
    """Prompt token ``i``'s log-probability given the tokens before it (None for the first
    token) and the most likely tokens at its place."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None]


@dataclass(frozen=True)
class Result:
    """One finished sample of a job."""

    token_ids: list[int]  # generated tokens only
    text: str | None  # None when the job is not detokenized (or the model has no tokenizer)
    finish_reason: str  # "stop", "length", "cancelled" or "error"
    num_prompt_tokens: int
    index: int = 0
    logprobs: list[float] | None = None  # one per generated token, when asked for
    top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: PromptLogprob | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id; None at EOS
    queue_time_s: float = 0.0  # from arrival to its first step
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served, not computed


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    result: Result | None = None
    text: SampleText | None = None  # its text, when this client makes it


# A delta in ``JobState._marks``: sample index, token start and stop, its text's place in
# ``JobState._texts`` (-1: none), and 1 for a sample's last delta (its finish), else 0.
_MARK = struct.Struct("=5q")


class JobState:
    """Everything known of one job of ``n`` samples. Not thread-safe: the owner locks."""

    def __init__(
        self, request_id: int, params: SamplingParams, detokenizer: Detokenizer | None = None
    ) -> None:
        """``detokenizer``: this client makes the job's text (the engine sends ids only)."""
        self.request_id = request_id
        self.params = params
        self.samples = [_Sample() for _ in range(params.n)]
        if detokenizer is not None and params.detokenize:
            for sample in self.samples:
                sample.text = detokenizer.sample(
                    params.stop,
                    params.min_tokens,
                    skip_special_tokens=params.skip_special_tokens,
                    include_stop=params.include_stop_str_in_output,
                )
        # What each step added, in arrival order, a ``_MARK`` a delta over the sample's lists;
        # readers keep a cursor and get ``Delta``s made from them. Bytes are nothing the
        # garbage collector visits: an object kept per job per step (a delta with its token
        # list, even a plain tuple) made the client's full collections grow with every step,
        # pauses of tens of milliseconds at 256 jobs on the thread that must keep up with the
        # engine (docs/PERFORMANCE.md).
        self._marks = bytearray()
        self._texts: list[str] = []  # the deltas' texts that are not empty
        self.prompt_logprobs: PromptLogprob | None = None
        self.error: Exception | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or all(s.result is not None for s in self.samples)

    def require_one_sample(self, instead: str) -> None:
        """For the readers of one sample's output: a job of several has ``instead``."""
        if self.params.n != 1:
            raise ValueError(f"job {self.request_id} has {self.params.n} samples: {instead}")

    @property
    def num_deltas(self) -> int:
        return len(self._marks) // _MARK.size

    def has_news_after(self, seen: int) -> Callable[[], bool]:
        """A predicate: a delta past the first ``seen`` arrived, or the job is over."""
        return lambda: self.num_deltas > seen or self.done

    def deltas(self, start: int = 0) -> list[Delta]:
        """The deltas past the first ``start``, in arrival order."""
        marks = self._marks[start * _MARK.size :]
        return [self._delta(*mark) for mark in _MARK.iter_unpack(marks)]

    def _delta(self, index: int, start: int, stop: int, text: int, finish: int) -> Delta:
        sample, logprobs = self.samples[index], self.params.logprobs
        if finish:
            assert sample.result is not None
            result = sample.result
            return Delta(
                index, [], "", finish_reason=result.finish_reason, stop_reason=result.stop_reason
            )
        return Delta(
            index,
            sample.token_ids[start:stop],
            self._texts[text] if text >= 0 else "",
            sample.logprobs[start:stop] if logprobs is not None else None,
            sample.top_logprobs[start:stop] if logprobs else None,
        )

    def on_tokens(self, frame: Tokens, entry: int) -> int | None:
        """Apply one entry of a step's tokens. Returns the sample's index when a stop string
        matched here ended it: its owner cancels that sample on the engine."""
        index = frame.indices[entry] if frame.indices is not None else 0
        token_ids = frame.token_ids[entry]
        sample = self.samples[index]
        stopped = None
        if sample.text is None:  # the engine's text, if any
            entry_text = frame.texts[entry] if frame.texts is not None else ""
        else:
            if sample.text.stopped_by is not None:
                return None  # what the engine made before it heard of the stop: dropped
            end = frame.ends[entry] if frame.ends is not None else TokenEnd.MORE
            token_ids, entry_text = _add_text(sample.text, token_ids, end)
            if sample.text.stopped_by is not None and end == TokenEnd.MORE:
                stopped = index
        start = len(sample.token_ids)
        sample.token_ids.extend(token_ids)
        n = len(token_ids)
        # A job that asked for log-probabilities gets them in every frame that moves it, so
        # its lists stay in step with its tokens and a delta's positions index all three.
        if frame.logprobs is not None and self.params.logprobs is not None:
            sample.logprobs.extend(frame.logprobs[entry][:n])
        if frame.top_ids is not None and frame.top_logprobs is not None and self.params.logprobs:
            sample.top_logprobs.extend(
                list(zip(ids, lps, strict=True))
                for ids, lps in zip(
                    frame.top_ids[entry][:n], frame.top_logprobs[entry][:n], strict=True
                )
            )
        text = -1
        if entry_text:
            text = len(self._texts)
            self._texts.append(entry_text)
        self._marks += _MARK.pack(index, start, start + n, text, 0)
        return stopped

    def on_prompt_logprobs(self, message: PromptLogprobs) -> None:
        def top(i: int) -> TopLogprobs:
            return list(zip(message.top_ids[i], message.top_logprobs[i], strict=True))

        n = len(message.logprobs)
        self.prompt_logprobs = PromptLogprob(
            list(message.prompt_token_ids),
            [None, *message.logprobs],
            [None, *(top(i) for i in range(n))],
        )

    def on_finished(self, message: Finished) -> None:
        sample = self.samples[message.index]
        params = self.params
        text, reason, stop_reason = message.text, message.finish_reason, message.stop_reason
        if sample.text is not None:
            # A sample's last token streamed what was held back for stop strings; one
            # cancelled (or stopped here) has no last token, and its text takes it now.
            sample.text.release()
            text = sample.text.text
            if sample.text.stopped_by is not None:  # the engine heard of it as a cancel
                reason, stop_reason = "stop", sample.text.stopped_by
        sample.result = Result(
            token_ids=list(sample.token_ids),
            text=text,
            finish_reason=reason,
            num_prompt_tokens=message.num_prompt_tokens,
            index=message.index,
            logprobs=list(sample.logprobs) if params.logprobs is not None else None,
            top_logprobs=list(sample.top_logprobs) if params.logprobs else None,
            prompt_logprobs=self.prompt_logprobs,
            stop_reason=stop_reason,
            queue_time_s=message.queue_time_s,
            num_cached_tokens=message.num_cached_tokens,
        )
        end = len(sample.token_ids)
        self._marks += _MARK.pack(message.index, end, end, -1, 1)

    def on_error(self, error: Exception) -> bool:
        """Fail the job unless it is over; whether it was failed."""
        if self.done:
            return False
        self.error = error
        return True

    def results(self) -> list[Result]:
        """Every sample's result, by index; raises the job's error if it failed."""
        if self.error is not None:
            raise self.error
        results = [s.result for s in self.samples]
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]


def _add_text(text: SampleText, token_ids: list[int], end: int) -> tuple[list[int], str]:
    """Decode one entry's tokens into ``text``: the tokens it keeps (those up to a stop
    string's match) and the text they stream, as the engine's text stage streams it."""
    if end == TokenEnd.MORE and len(token_ids) == 1:  # a step's token: most entries
        return token_ids, text.add(token_ids[0])
    pieces = []
    last = len(token_ids) - 1
    for i, token_id in enumerate(token_ids):
        pieces.append(text.add(token_id, stop_terminated=i == last and end == TokenEnd.STOP_TOKEN))
        if text.stopped_by is not None:
            return token_ids[: i + 1], "".join(pieces)
    if end != TokenEnd.MORE:  # its last token: the text held back for stop strings goes too
        pieces.append(text.release())
    return token_ids, "".join(pieces)


# --- routing the engine's replies ------------------------------------------------------------

JobChange = Callable[[JobState], object]


class ReplySink(Protocol):
    """What a client does with the replies ``route_reply`` hands it."""

    def on_welcome(self, message: Welcome) -> None: ...

    def on_stats(self, message: Stats) -> None: ...

    def update_job(self, request_id: int, change: JobChange) -> bool:
        """Apply ``change`` to the job's state and wake its readers; forget the job once it
        is done. False when no unfinished job has that id."""
        ...

    def on_tokens(self, message: Tokens) -> None:
        """Apply each entry of one step's tokens to its job (``JobState.on_tokens``) and wake
        that job's readers; entries of jobs no longer known are dropped. Tokens never finish
        a job, so none is forgotten here."""
        ...


def route_reply(frame: bytes, sink: ReplySink) -> None:
    """Decode one frame from the engine and hand it to ``sink``; a frame that cannot be
    decoded is logged and dropped."""
    try:
        message = decode(frame, expected=REPLY_TYPES)
    except ProtocolError as exc:
        log.warning("ignored a frame from the engine: %s", exc)
        return
    _ROUTES[type(message)](message, sink)


def _route_prompt_logprobs(message: PromptLogprobs, sink: ReplySink) -> None:
    sink.update_job(
        message.request_id, functools.partial(JobState.on_prompt_logprobs, message=message)
    )


def _route_finished(message: Finished, sink: ReplySink) -> None:
    sink.update_job(message.request_id, functools.partial(JobState.on_finished, message=message))


def _route_error(message: Error, sink: ReplySink) -> None:
    error = error_for(message.kind, message.message)
    if message.request_id is None or not sink.update_job(
        message.request_id, functools.partial(JobState.on_error, error=error)
    ):
        log.warning("engine error not tied to a job: %s", message.message)


_ROUTES: dict[type, Callable[[Any, ReplySink], None]] = {
    Welcome: lambda message, sink: sink.on_welcome(message),
    Stats: lambda message, sink: sink.on_stats(message),
    # A frame holds one step's tokens for every job that moved (256 entries at a batch of
    # 256): the sink applies them together rather than as a change per entry, which at a
    # few microseconds each left a client's thread slower than the engine's steps.
    Tokens: lambda message, sink: sink.on_tokens(message),
    PromptLogprobs: _route_prompt_logprobs,
    Finished: _route_finished,
    Error: _route_error,
}
assert set(_ROUTES) == set(REPLY_TYPES)
