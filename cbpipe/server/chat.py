"""``POST /v1/chat/completions``: a conversation rendered by the model's chat template (in
this process: the scheduler gets token ids), answered as one assistant message per sample,
streaming or not; with ``tools``, the calls the reply makes (``tools.py``) as its
``tool_calls``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
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
from cbpipe.server.text import Text, TextError
from cbpipe.server.tools import StreamedReply, ToolCall, ToolCallParser


async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: ServerState
) -> Response:
    state.check_model(body.model)
    max_tokens_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    use = tool_use(body, state.tool_parser)
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
    )
    try:
        generation = Generation(state.client, state.metrics, [prompt], [limit], options)
    except Exception as exc:
        raise from_engine(exc, max_tokens_name) from None
    if body.stream:
        return await _stream(generation, body, request, state, max_tokens_name, use)
    return await _complete(generation, body, request, state, max_tokens_name, use)


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


@dataclass(frozen=True)
class ToolUse:
    """How a request's replies are read for tool calls."""

    parser: ToolCallParser
    parallel: bool  # parallel_tool_calls: false keeps a reply's first call only

    def answer(
        self, calls: list[ToolCall], finish_reason: str | None, streamed: bool
    ) -> tuple[list[dict[str, Any]], str | None]:
        """A reply's calls as OpenAI's ``tool_calls``, and its finish reason: a reply that
        ended by itself ended to call."""
        kept = calls if self.parallel else calls[:1]
        openai = [call.as_openai(i if streamed else None) for i, call in enumerate(kept)]
        return openai, "tool_calls" if finish_reason == "stop" else finish_reason


def tool_use(body: ChatCompletionRequest, parser: ToolCallParser | None) -> ToolUse | None:
    """Whether (and how) to look for tool calls in this request's replies: with ``tools``
    and ``tool_choice`` "auto" (the default with tools), on a server started to. Nothing
    can force a call, so "required" and a named function are refused."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None  # the template still shows the tools, as vLLM's does
    if choice is not None and choice != "auto":
        raise APIError(
            400,
            "cbpipe cannot force a tool call (it has no structured output): use tool_choice "
            '"auto" or "none"',
            param="tool_choice",
        )
    if parser is None:
        raise APIError(
            400,
            '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
            "--tool-call-parser",
            param="tool_choice",
        )
    return ToolUse(parser, parallel=body.parallel_tool_calls is not False)


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
        reply = use.parser.parse(result.text or "")
        if reply.calls:
            message["content"] = reply.content.strip() or None
            message["tool_calls"], finish_reason = use.answer(reply.calls, finish_reason, False)
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
    max_tokens_name: str,
    use: ToolUse | None,
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
    max_tokens_name: str,
    use: ToolUse | None,
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
    replies: dict[int, StreamedReply] = {}  # each sample's text, read for tool calls

    def choices_of(batch: Batch) -> Iterator[list[dict[str, Any]]]:
        for choice in _batch_choices(text, body, batch, started, use, replies):
            yield [choice]

    return stream_events(generation, body.stream_options, envelope, first, batches, choices_of)


def _batch_choices(
    text: Text,
    body: ChatCompletionRequest,
    batch: Batch,
    started: set[int],
    use: ToolUse | None,
    replies: dict[int, StreamedReply],
) -> list[dict[str, Any]]:
    """One chunk's choice per sample that moved: its deltas in this batch joined. A
    sample's first chunk carries the assistant's role; with tools, the text that may be a
    call waits, and the calls go out with the sample's last chunk."""
    choices = []
    for index, entry in batch.by_sample().items():
        message: dict[str, Any] = {}
        if index not in started:
            started.add(index)
            message["role"] = "assistant"
        content, calls = entry.text, list[ToolCall]()
        finish_reason = entry.finish_reason
        if use is not None:
            reply = replies.setdefault(index, StreamedReply(use.parser))
            content = reply.feed(entry.text)
            if finish_reason is not None:
                rest, calls = reply.finish()
                content += rest
        if entry.token_ids or content or "role" in message:
            message["content"] = content
        if calls:
            assert use is not None
            message["tool_calls"], finish_reason = use.answer(calls, finish_reason, True)
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
