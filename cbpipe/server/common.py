"""What the completions and chat endpoints share: sampling options from a request, the
server state, the event stream, and cancelling a request whose client went away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cbpipe.client import AsyncClient, SamplingOptions, StructuredOutput
from cbpipe.client.jobs import TopLogprobs
from cbpipe.server.errors import APIError, from_engine
from cbpipe.server.generation import Batch, Generation
from cbpipe.server.metrics import ServerMetrics
from cbpipe.server.schemas import StreamOptions, _SamplingFields
from cbpipe.server.text import Text
from cbpipe.server.tools import ToolCallParser


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets, where the model's authors
    recommend a value in its ``generation_config.json`` (vLLM's ``--generation-config
    auto``); a field left None falls back to OpenAI's default. transformers' own defaults
    (``top_k`` 50 among them) are not recommendations: only the file's own keys count."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the file's max_new_tokens

    @classmethod
    def from_folder(cls, folder: Path | None) -> SamplingDefaults:
        """The defaults in ``folder``'s ``generation_config.json``; none without one."""
        file = None if folder is None else folder / "generation_config.json"
        if file is None or not file.is_file():
            return cls()
        recommended = json.loads(file.read_text())
        recommended["max_tokens"] = recommended.get("max_new_tokens")
        given: dict[str, Any] = {
            f.name: value
            for f in fields(cls)
            if isinstance(value := recommended.get(f.name), (int, float))
        }
        return cls(**given)

    @classmethod
    def chosen(cls, setting: str, model_folder: Path | None) -> SamplingDefaults:
        """The defaults ``--generation-config`` asks for: "auto" (the model's), "none", or a
        folder's."""
        if setting == "none":
            return cls()
        return cls.from_folder(model_folder if setting == "auto" else Path(setting))

    def describe(self) -> str:
        """``temperature 0.6, top_p 0.9``, or "" for none."""
        given = [(f.name, getattr(self, f.name)) for f in fields(self)]
        return ", ".join(f"{name} {value:g}" for name, value in given if value is not None)


@dataclass
class ServerState:
    """Everything a request handler needs, built once per server process."""

    client: AsyncClient
    text: Text
    metrics: ServerMetrics
    model_name: str
    api_key: str | None = None
    created: int = 0  # when the model was loaded (for /v1/models)
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # Where --enable-auto-tool-choice: how replies are read for tool calls.
    tool_parser: ToolCallParser | None = None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )


def max_new_tokens(
    requested: int | None, default: int | None, prompt_len: int, max_model_len: int, param: str
) -> int:
    """A prompt's output limit. What the request asks must fit beside the prompt in the
    model's length, or it is vLLM's 400: a client must not mistake the engine's cut for its
    own limit. A default is cut to fit; no default means as long as the model allows. A
    prompt that fills the length alone is left to the engine, whose 400 says so."""
    room = max_model_len - prompt_len
    if room < 1:
        return requested or default or 1
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(
            400,
            f"{param} is too large: {requested}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({requested} > {max_model_len} - {prompt_len})",
            param=param,
        )
    return requested


def sampling_options(
    request: _SamplingFields,
    *,
    detokenize: bool,
    defaults: SamplingDefaults | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    structured_output: StructuredOutput | None = None,
) -> SamplingOptions:
    """The engine's options for an OpenAI request: a field left out takes the model's
    recommended default, if any, else OpenAI's (temperature 1.0)."""
    defaults = defaults or SamplingDefaults()
    values: dict[str, Any] = {
        "n": request.n or 1,
        "temperature": 1.0,  # OpenAI's
        "detokenize": detokenize,
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "min_p",
        "min_tokens",
        "repetition_penalty",
        "ignore_eos",
        "stop",
        "stop_token_ids",
        "cache_salt",
        "skip_special_tokens",
        "include_stop_str_in_output",
    ):
        value = getattr(request, name)
        if value is None:
            value = getattr(defaults, name, None)
        if value is not None:
            values[name] = value
    if values.get("top_k") == -1:  # vLLM's -1: no limit
        values["top_k"] = 0
    if request.logit_bias:
        try:
            values["logit_bias"] = {int(k): v for k, v in request.logit_bias.items()}
        except ValueError:
            raise APIError(
                400, "logit_bias keys must be token ids (integers)", param="logit_bias"
            ) from None
    if logprobs is not None:
        values["logprobs"] = logprobs
    if prompt_logprobs is not None:
        values["prompt_logprobs"] = prompt_logprobs
    if structured_output is not None:
        values["structured_output"] = structured_output
    if request.stream_options is not None and not request.stream:
        raise APIError(
            400, "stream_options is only allowed with stream: true", param="stream_options"
        )
    return cast(SamplingOptions, values)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def top_alternatives(text: Text, top: TopLogprobs) -> Iterator[tuple[str, float]]:
    return ((text.token_string(token_id), logprob) for token_id, logprob in top)


def dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class Envelope:
    """The constant part of every chunk of one stream, encoded once: only the choices
    change from one event to the next."""

    def __init__(self, fields: dict[str, Any]) -> None:
        head = dumps({**fields, "choices": []})
        assert head.endswith('"choices":[]}')
        self._prefix = ("data: " + head[: -len("]}")]).encode()

    def event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        tail = "".join(f',"{key}":{dumps(value)}' for key, value in extra.items())
        return self._prefix + f"{','.join(map(dumps, choices))}]{tail}}}\n\n".encode()


DONE = b"data: [DONE]\n\n"


async def stream_events(
    generation: Generation,
    options: StreamOptions | None,
    envelope: Envelope,
    first: Batch | None,
    batches: AsyncIterator[Batch],
    choices_of: Callable[[Batch], Iterator[list[dict[str, Any]]]],
) -> AsyncIterator[bytes]:
    """A stream's server-sent events: one per choice list ``choices_of`` makes of each batch
    (with the usage so far where ``continuous_usage_stats`` asks), an error event if the
    engine fails, the usage event ``include_usage`` asks for, then ``[DONE]``."""
    continuous = bool(options and options.continuous_usage_stats)

    def so_far() -> dict[str, Any]:
        if not continuous:
            return {}
        return {"usage": generation.usage()}

    try:
        batch = first
        while batch is not None:
            for choices in choices_of(batch):
                yield envelope.event(choices, **so_far())
            batch = await anext(batches, None)
    except Exception as exc:
        yield from_engine(exc).event()
    else:
        await generation.results()  # records the finished samples in the metrics
        if options and options.include_usage:
            yield envelope.event([], usage=generation.usage())
    yield DONE


async def first_batch_then(
    generation: Generation, request: Request, names: Mapping[str, str]
) -> tuple[Any, AsyncIterator[Any]]:
    """The first batch of a stream, awaited before the status line goes out so that an
    engine's refusal is still a 400 (or 503, ``from_engine``'s ``names``); and the batches
    after it."""
    batches = generation.batches()
    async with cancelled_on_disconnect(request, generation):
        try:
            first = await anext(batches)
        except StopAsyncIteration:
            first = None
        except Exception as exc:
            raise from_engine(exc, names) from None
    return first, batches


class EventStream(StreamingResponse):
    """Server-sent events of ``generation`` from ``events``. When the client goes away,
    ``client_left`` runs at once (it cancels the request's jobs: their blocks are freed
    without waiting for the next token to fail to send); when the stream ends, what is
    unfinished is cancelled (nothing, unless it ended on an error)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], generation: Generation) -> None:
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        super().__init__(events, headers=headers, media_type=self.media_type)
        self.events = events
        self.on_close = generation.cancel_unfinished
        self.on_disconnect = generation.client_left

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        watcher.add_done_callback(lambda task: None if task.cancelled() else self.on_disconnect())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                if watcher.done():
                    break
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self.on_close()
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()


@contextlib.asynccontextmanager
async def cancelled_on_disconnect(request: Request, generation: Generation) -> AsyncIterator[None]:
    """Cancel the generation's jobs if the client disconnects inside the block."""
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    watcher.add_done_callback(
        lambda task: None if task.cancelled() else generation.cancel_unfinished()
    )
    try:
        yield
    finally:
        watcher.cancel()


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
