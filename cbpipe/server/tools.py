"""Tool calls in a chat reply: found in the model's text by the format its chat template
taught it (``--tool-call-parser``, vLLM's names), returned as OpenAI's ``tool_calls``.

A parser splits a reply into the content outside the calls and the calls. Streaming, the
content goes out as it comes except what may be the start of a call (``split``); the
calls go out whole once the sample is over, so a reply that only looked like a call
(malformed JSON, a cut-off) is sent as the text it is. Nothing constrains what the model
writes here (``tool_choice`` "auto"); ``tool_choice.py`` forces calls (a named function,
"required") through structured output, and reads them without a parser.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ParsedReply:
    content: str  # the text outside the calls, as the model wrote it
    calls: list[ToolCall]


class ToolCallParser:
    """One format of tool calls; ``parse`` never raises: a reply it cannot read whole is
    content."""

    name: ClassVar[str]

    def parse(self, text: str) -> ParsedReply:
        raise NotImplementedError

    def split(self, pending: str, at_start: bool) -> tuple[int, bool]:
        """For a streamed reply's text not yet sent (``at_start``: none was): how much of it
        is content to send now, and whether what follows may belong to a call, to be held
        until the reply is over."""
        raise NotImplementedError


def call_of(obj: object, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded JSON object ``{"name": ..., "<arguments key>": {...}}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments: Any = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call: the
    format of Hermes, Qwen 2.5 and Qwen 3 chat templates."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedReply:
        first = text.find(self.START)
        if first < 0:
            return ParsedReply(text, [])
        calls, rest = [], text[first:]
        while rest.startswith(self.START):
            body, found, after = rest[len(self.START) :].partition(self.END)
            call = self._decode(body)
            if call is None or not (found or not after.strip()):
                return ParsedReply(text, [])
            calls.append(call)
            rest = after.lstrip()
        if rest:  # text after the calls: not a reply of calls
            return ParsedReply(text, [])
        return ParsedReply(text[:first], calls)

    def split(self, pending: str, at_start: bool) -> tuple[int, bool]:
        start = pending.find(self.START)
        if start >= 0:
            return start, True
        # A suffix that the marker may go on from waits for the next text.
        for size in range(min(len(self.START) - 1, len(pending)), 0, -1):
            if self.START.startswith(pending[-size:]):
                return len(pending) - size, False
        return len(pending), False

    @staticmethod
    def _decode(body: str) -> ToolCall | None:
        try:
            return call_of(json.loads(body), ("arguments", "parameters"))
        except json.JSONDecodeError:
            return None


class Llama3JsonParser(ToolCallParser):
    """A reply that is JSON objects ``{"name": ..., "parameters": {...}}`` (separated by
    ``;``): Llama 3.1 and 3.2's JSON tool calling. A reply that starts with anything but
    ``{`` is content."""

    name = "llama3_json"

    def parse(self, text: str) -> ParsedReply:
        body = text.lstrip()
        if not body.startswith("{"):
            return ParsedReply(text, [])
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return ParsedReply(text, [])
            call = call_of(obj, ("parameters", "arguments"))
            if call is None:
                return ParsedReply(text, [])
            calls.append(call)
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return ParsedReply("", calls)

    def split(self, pending: str, at_start: bool) -> tuple[int, bool]:
        if not at_start:
            return len(pending), False  # the reply began as text: all of it is
        body = pending.lstrip()
        if not body:
            return 0, False  # undecided until its first character
        return (0, True) if body.startswith("{") else (len(pending), False)


PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser)
}


class StreamedReply:
    """One streamed sample's text, split as it comes: ``feed`` gives the content that can go
    out now; ``finish`` the rest of it and the calls. Linear in the reply's length: only the
    text not yet sent is searched, and once a call may have begun nothing is until the end."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._parts: list[str] = []  # the whole reply, joined once at the end
        self._pending = ""  # text neither sent nor held to the end (a marker's first part)
        self._num_sent = 0  # characters sent as content
        self._holding = False

    def feed(self, delta: str) -> str:
        self._parts.append(delta)
        if self._holding:
            return ""
        self._pending += delta
        ready, self._holding = self._parser.split(self._pending, at_start=self._num_sent == 0)
        out, self._pending = self._pending[:ready], self._pending[ready:]
        self._num_sent += ready
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        text = "".join(self._parts)
        reply = self._parser.parse(text)
        end = len(reply.content) if reply.calls else len(text)
        rest = text[self._num_sent : end] if end > self._num_sent else ""
        self._num_sent, self._pending, self._holding = len(text), "", True
        return rest, reply.calls
