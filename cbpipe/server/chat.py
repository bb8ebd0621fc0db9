"""``POST /v1/chat/completions``: a conversation rendered by the model's chat template (in
this process: the scheduler gets token ids), answered as one assistant message per sample,
streaming or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from cbpipe.client import Result
from cbpipe.client.jobs import TopLogprobs
from cbpipe.server.common import (
    Envelope,
    EventStream,
    ServerState,
    cancelled_on_disconnect,
    first_batch_then,
    new_id,
    now_s,
    sampling_options,
    stream_events,
)
from cbpipe.server.errors import APIError, from_engine
from cbpipe.server.generation import Batch, Generation
from cbpipe.server.schemas import ChatCompletionRequest
from cbpipe.server.text import Text, TextError


async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: ServerState
) -> Response:
    state.check_model(body.model)
    max_tokens_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    messages = [as_template_message(m.role, m.content, m.name) for m in body.messages]
    try:
        prompt = await asyncio.to_thread(  # off the event loop, as a completion's prompt
            state.text.chat_prompt,
            messages,
            add_generation_prompt=bool(body.add_generation_prompt),
            continue_final_message=bool(body.continue_final_message),
        )
    except TextError as exc:
        raise APIError(400, str(exc), param="messages") from None
    limit = body.max_completion_tokens or body.max_tokens or state.defaults.max_tokens
    if limit is None:  # as long as the model allows (the engine ends it at its limit)
        limit = max(1, state.client.max_model_len - len(prompt))
    options = sampling_options(
        body,
        detokenize=state.text.has_tokenizer,
        defaults=state.defaults,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )
    try:
        generation = Generation(state.client, state.metrics, [prompt], [limit], options)
    except Exception as exc:
        raise from_engine(exc, max_tokens_name) from None
    if body.stream:
        return await _stream(generation, body, request, state, max_tokens_name)
    return await _complete(generation, body, request, state, max_tokens_name)


def as_template_message(role: str, content: object, name: str | None) -> dict[str, str]:
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        assert isinstance(content, list)
        text = "".join(part.text for part in content)
    message = {"role": role, "content": text}
    if name is not None:
        message["name"] = name
    return message


def _content_logprobs(
    text: Text, token_ids: list[int], logprobs: list[float], tops: list[TopLogprobs]
) -> list[dict[str, Any]]:
    entries = []
    for token_id, logprob, top in zip(token_ids, logprobs, tops, strict=True):
        token = text.token_string(token_id)
        alternatives = []
        for alt_id, alt_logprob in top:
            alt = text.token_string(alt_id)
            alternatives.append({"token": alt, "logprob": alt_logprob, "bytes": list(alt.encode())})
        entries.append(
            {
                "token": token,
                "logprob": logprob,
                "bytes": list(token.encode()),
                "top_logprobs": alternatives,
            }
        )
    return entries


def _result_choice(text: Text, body: ChatCompletionRequest, result: Result) -> dict[str, Any]:
    if result.finish_reason == "error":
        raise APIError(500, "the engine failed this request", code="engine_error")
    logprobs = None
    if body.logprobs:
        assert result.logprobs is not None
        tops = result.top_logprobs or [[] for _ in result.logprobs]
        content = _content_logprobs(text, result.token_ids, result.logprobs, tops)
        logprobs = {"content": content, "refusal": None}
    entry: dict[str, Any] = {
        "index": result.index,
        "message": {"role": "assistant", "content": result.text or "", "refusal": None},
        "logprobs": logprobs,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
    }
    if body.return_token_ids:
        entry["token_ids"] = result.token_ids
    return entry


async def _complete(
    generation: Generation,
    body: ChatCompletionRequest,
    request: Request,
    state: ServerState,
    max_tokens_name: str,
) -> Response:
    async with cancelled_on_disconnect(request, generation):
        try:
            async for _ in generation.batches():
                pass
            (results,) = await generation.results()
        except Exception as exc:
            raise from_engine(exc, max_tokens_name) from None
    response: dict[str, Any] = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": now_s(),
        "model": state.model_name,
        "choices": [_result_choice(state.text, body, r) for r in results],
        "usage": generation.usage(),
    }
    if body.return_token_ids:
        response["prompt_token_ids"] = generation.prompts[0]
    return JSONResponse(response)


async def _stream(
    generation: Generation,
    body: ChatCompletionRequest,
    request: Request,
    state: ServerState,
    max_tokens_name: str,
) -> Response:
    first, batches = await first_batch_then(generation, request, max_tokens_name)
    envelope = Envelope(
        {
            "id": new_id("chatcmpl"),
            "object": "chat.completion.chunk",
            "created": now_s(),
            "model": state.model_name,
        }  # fmt: skip
    )
    events = _events(generation, body, state.text, envelope, first, batches)
    return EventStream(events, generation.cancel_unfinished)


def _events(
    generation: Generation,
    body: ChatCompletionRequest,
    text: Text,
    envelope: Envelope,
    first: Batch | None,
    batches: AsyncIterator[Batch],
) -> AsyncIterator[bytes]:
    started: set[int] = set()  # samples whose role went out

    def choices_of(batch: Batch) -> Iterator[list[dict[str, Any]]]:
        for choice in _batch_choices(text, body, batch, started):
            yield [choice]

    return stream_events(generation, body.stream_options, envelope, first, batches, choices_of)


def _batch_choices(
    text: Text, body: ChatCompletionRequest, batch: Batch, started: set[int]
) -> list[dict[str, Any]]:
    """One chunk's choice per sample that moved: its deltas in this batch joined. A
    sample's first chunk carries the assistant's role."""
    choices = []
    for index, entry in batch.by_sample().items():
        message: dict[str, Any] = {}
        if index not in started:
            started.add(index)
            message["role"] = "assistant"
        if entry.token_ids or entry.text or "role" in message:
            message["content"] = entry.text
        out: dict[str, Any] = {
            "index": index,
            "delta": message,
            "logprobs": None,
            "finish_reason": entry.finish_reason,
        }
        if body.logprobs and entry.token_ids:
            content = _content_logprobs(text, entry.token_ids, entry.logprobs, entry.top_logprobs)
            out["logprobs"] = {"content": content, "refusal": None}
        if body.return_token_ids:
            out["token_ids"] = entry.token_ids
        choices.append(out)
    return choices
