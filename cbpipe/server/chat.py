"""``POST /v1/chat/completions``: a conversation rendered by the model's chat template (in
this process: the scheduler gets token ids), answered as one assistant message per sample,
streaming or not; with ``tools``, the calls the reply makes (``tool_choice.py``) as its
``tool_calls``; with structured output (``structured.py``), text that follows it."""

from __future__ import annotations

import asyncio
import json
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
    max_new_tokens,
    new_id,
    now_s,
    sampling_options,
    stream_events,
)
from cbpipe.server.errors import APIError, from_engine
from cbpipe.server.generation import Batch, Generation
from cbpipe.server.schemas import ChatCompletionRequest, ChatMessage, TokenizeRequest
from cbpipe.server.structured import only_one, requested_constraint
from cbpipe.server.text import Text, TextError
from cbpipe.server.tool_choice import ReplyReader, StreamedPart, ToolUse, tool_use


async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: ServerState
) -> Response:
    state.check_model(body.model)
    max_tokens_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    if body.top_logprobs and not body.logprobs:  # 0 asks for nothing: accepted, as vLLM does
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    use = tool_use(body, state.tool_parser)
    constraint = only_one([None if use is None else use.constraint, requested_constraint(body)])
    names = {"max_tokens": max_tokens_name}
    if constraint is not None:
        names["structured_outputs"] = constraint.param
    try:
        prompt = await render_conversation(state.text, body)
    except TextError as exc:
        raise APIError(400, str(exc), param="messages") from None
    limit = max_new_tokens(
        body.max_completion_tokens or body.max_tokens,
        state.defaults.max_tokens,
        len(prompt),
        state.client.max_model_len,
        max_tokens_name,
    )
    options = sampling_options(
        body,
        detokenize=state.text.has_tokenizer,
        defaults=state.defaults,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        structured_output=None if constraint is None else constraint.output,
    )
    try:
        generation = Generation(state.client, state.metrics, [prompt], [limit], options)
    except Exception as exc:
        raise from_engine(exc, names) from None
    if body.stream:
        return await _stream(generation, body, request, state, names, use)
    return await _complete(generation, body, request, state, names, use)


async def render_conversation(
    text: Text, request: ChatCompletionRequest | TokenizeRequest
) -> list[int]:
    """The token ids the chat template makes of a request's messages and tools, rendered off
    the event loop (a long conversation must not stall the other streams); ``TextError`` for
    a conversation the template refuses."""
    assert request.messages is not None  # a /tokenize of a prompt never comes here
    rendered = [template_message(m, f"messages[{i}]") for i, m in enumerate(request.messages)]
    tools = request.tools
    return await asyncio.to_thread(
        text.chat_prompt,
        rendered,
        add_generation_prompt=bool(request.add_generation_prompt),
        continue_final_message=bool(request.continue_final_message),
        tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
    )


def template_message(message: ChatMessage, where: str) -> dict[str, Any]:
    """A message as chat templates read it: text content, and an assistant's calls with
    their arguments as objects."""
    content = message.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = "".join(part.text for part in content)
    if message.role == "tool" and message.tool_call_id is None:
        param = f"{where}.tool_call_id"
        raise APIError(400, f"{param} is required: the call a tool message answers", param=param)
    if message.tool_call_id is not None and message.role != "tool":
        param = f"{where}.tool_call_id"
        raise APIError(400, f"{param} belongs to tool messages only", param=param)
    if message.tool_calls and message.role != "assistant":
        param = f"{where}.tool_calls"
        raise APIError(400, f"{param} belongs to assistant messages only", param=param)
    rendered: dict[str, Any] = {"role": message.role, "content": text}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:  # templates of reasoning models read it
        rendered["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        rendered["tool_calls"] = []
        for j, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                param = f"{where}.tool_calls[{j}].function.arguments"
                raise APIError(400, f"{param} must be a JSON object", param=param)
            function = {"name": call.function.name, "arguments": arguments}
            rendered["tool_calls"].append({"id": call.id, "type": "function", "function": function})
    return rendered


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


def _result_choice(
    text: Text, body: ChatCompletionRequest, result: Result, use: ToolUse | None
) -> dict[str, Any]:
    if result.finish_reason == "error":
        raise APIError(500, "the engine failed this request", code="engine_error")
    message: dict[str, Any] = {"role": "assistant", "content": result.text or "", "refusal": None}
    finish_reason: str | None = result.finish_reason
    if use is not None:
        reply = use.read(result.text or "")
        if reply.calls:
            message["content"] = reply.content.strip() or None
            message["tool_calls"] = [call.as_openai() for call in reply.calls]
            finish_reason = use.finish_reason(finish_reason)
    logprobs = None
    if body.logprobs:
        assert result.logprobs is not None
        tops = result.top_logprobs or [[] for _ in result.logprobs]
        content = _content_logprobs(text, result.token_ids, result.logprobs, tops)
        logprobs = {"content": content, "refusal": None}
    entry: dict[str, Any] = {
        "index": result.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
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
    names: dict[str, str],
    use: ToolUse | None,
) -> Response:
    async with cancelled_on_disconnect(request, generation):
        try:
            async for _ in generation.batches():
                pass
            (results,) = await generation.results()
        except Exception as exc:
            raise from_engine(exc, names) from None
    response: dict[str, Any] = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": now_s(),
        "model": state.model_name,
        "choices": [_result_choice(state.text, body, r, use) for r in results],
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
    names: dict[str, str],
    use: ToolUse | None,
) -> Response:
    first, batches = await first_batch_then(generation, request, names)
    envelope = Envelope(
        {
            "id": new_id("chatcmpl"),
            "object": "chat.completion.chunk",
            "created": now_s(),
            "model": state.model_name,
        }  # fmt: skip
    )
    events = _events(generation, body, state.text, envelope, first, batches, use)
    return EventStream(events, generation)


def _events(
    generation: Generation,
    body: ChatCompletionRequest,
    text: Text,
    envelope: Envelope,
    first: Batch | None,
    batches: AsyncIterator[Batch],
    use: ToolUse | None,
) -> AsyncIterator[bytes]:
    started: set[int] = set()  # samples whose role went out
    readers: dict[int, ReplyReader] = {}  # each sample's text, read for tool calls

    def choices_of(batch: Batch) -> Iterator[list[dict[str, Any]]]:
        for choice in _batch_choices(text, body, batch, started, use, readers):
            yield [choice]

    return stream_events(generation, body.stream_options, envelope, first, batches, choices_of)


def _batch_choices(
    text: Text,
    body: ChatCompletionRequest,
    batch: Batch,
    started: set[int],
    use: ToolUse | None,
    readers: dict[int, ReplyReader],
) -> list[dict[str, Any]]:
    """One chunk's choice per sample that moved: its deltas in this batch joined. A
    sample's first chunk carries the assistant's role; with tools, the text goes out as
    its ``ReplyReader`` lets it, as content or calls."""
    choices = []
    for index, entry in batch.by_sample().items():
        message: dict[str, Any] = {}
        if index not in started:
            started.add(index)
            message["role"] = "assistant"
        part = StreamedPart(entry.text)
        finish_reason = entry.finish_reason
        if use is not None:
            reader = readers.setdefault(index, use.reader())
            part = reader.feed(entry.text)
            if finish_reason is not None:
                part += reader.finish()
                if reader.made_calls:
                    finish_reason = use.finish_reason(finish_reason)
        if part.content or (not part.tool_calls and (entry.token_ids or "role" in message)):
            message["content"] = part.content
        if part.tool_calls:
            message["tool_calls"] = part.tool_calls
        out: dict[str, Any] = {
            "index": index,
            "delta": message,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": entry.stop_reason,  # vLLM's, in every chunk
        }
        if body.logprobs and entry.token_ids:
            scored = _content_logprobs(text, entry.token_ids, entry.logprobs, entry.top_logprobs)
            out["logprobs"] = {"content": scored, "refusal": None}
        if body.return_token_ids:
            out["token_ids"] = entry.token_ids
        choices.append(out)
    return choices
