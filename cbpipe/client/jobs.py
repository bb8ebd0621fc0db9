"""What both clients share: the request options, the results, and a job's state.

``JobState`` assembles what the engine sends for one job (tokens, text, log-probabilities,
finishes, errors) and knows nothing of threads, asyncio or sockets: ``Client`` feeds it from
its I/O thread, ``AsyncClient`` from its event loop, and each wakes its own waiters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import zmq

from cbpipe import env
from cbpipe.protocol.liveness import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS
from cbpipe.protocol.messages import ErrorKind, Finished, PromptLogprobs, Tokens
from cbpipe.protocol.sampling import SamplingParams
from cbpipe.protocol.security import CurveKeys, uses_curve


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
    cache_salt: str | None


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
    try:
        params = SamplingParams(max_new_tokens, **values)  # type: ignore[arg-type]
    except TypeError as exc:  # an option this client does not know
        raise RequestError(str(exc)) from None
    try:
        params.validate()
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    return params


def prompt_payload(prompt: object) -> str | list[int]:
    """A text prompt as is, or token ids as a list; anything else is a ``RequestError``."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        token_ids = list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            return token_ids
    raise RequestError("a prompt must be a string or a list of integer token ids")


TopLogprobs = list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass(frozen=True)
class Delta:
    """What one step added to one sample of a job; the last delta of a sample has its
    ``finish_reason`` (and may add no tokens)."""

    index: int
    token_ids: list[int]
    text: str  # "" when the job is not detokenized, or while a stop string may still match
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    finish_reason: str | None = None


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
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    queue_time_s: float = 0.0  # from arrival to its first step


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    result: Result | None = None


class JobState:
    """Everything known of one job of ``n`` samples. Not thread-safe: the owner locks."""

    def __init__(self, request_id: int, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.samples = [_Sample() for _ in range(params.n)]
        self.deltas: list[Delta] = []  # in arrival order; readers keep a cursor
        self.prompt_logprobs: PromptLogprob | None = None
        self.error: Exception | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or all(s.result is not None for s in self.samples)

    def has_news_after(self, seen: int) -> Callable[[], bool]:
        """A predicate: a delta past the first ``seen`` arrived, or the job is over."""
        return lambda: len(self.deltas) > seen or self.done

    def on_tokens(self, frame: Tokens, entry: int) -> None:
        index = frame.indices[entry] if frame.indices is not None else 0
        token_ids = frame.token_ids[entry]
        sample = self.samples[index]
        sample.token_ids.extend(token_ids)
        logprobs = top = None
        if frame.logprobs is not None and self.params.logprobs is not None:
            logprobs = frame.logprobs[entry]
            sample.logprobs.extend(logprobs)
        if frame.top_ids is not None and frame.top_logprobs is not None and self.params.logprobs:
            top = [
                list(zip(ids, lps, strict=True))
                for ids, lps in zip(frame.top_ids[entry], frame.top_logprobs[entry], strict=True)
            ]
            sample.top_logprobs.extend(top)
        text = frame.texts[entry] if frame.texts is not None else ""
        self.deltas.append(Delta(index, token_ids, text, logprobs, top))

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
        sample.result = Result(
            token_ids=list(sample.token_ids),
            text=message.text,
            finish_reason=message.finish_reason,
            num_prompt_tokens=message.num_prompt_tokens,
            index=message.index,
            logprobs=list(sample.logprobs) if params.logprobs is not None else None,
            top_logprobs=list(sample.top_logprobs) if params.logprobs else None,
            prompt_logprobs=self.prompt_logprobs,
            stop_reason=message.stop_reason,
            queue_time_s=message.queue_time_s,
        )
        self.deltas.append(Delta(message.index, [], "", finish_reason=message.finish_reason))

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
