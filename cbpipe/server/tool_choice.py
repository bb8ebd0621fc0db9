"""How a chat request's ``tool_choice`` shapes and reads its replies, as vLLM serves it.

- ``"auto"`` (the default once there are ``tools``, on a server started with
  ``--enable-auto-tool-choice``): the model writes what it likes, and the calls it makes are
  found in its text by the ``--tool-call-parser``'s format (``tools.py``).
- A named function: the reply is constrained to a JSON object of that function's
  ``parameters`` schema, and is one call of it with the reply's text as its ``arguments``;
  streamed, the arguments go out as they come (the first chunk names the function).
- ``"required"``: the reply is constrained to a JSON array of one or more
  ``{"name": <a tool's name>, "parameters": <that tool's parameters>}`` objects (vLLM's
  schema), each a call; streamed, each call goes out whole as soon as its object closes.
- ``"none"``, or no ``tools``: the reply is content (the template still shows the tools).

A reply of calls that ended by itself finishes with "tool_calls" for "auto" and "required"
and with "stop" for a named function: OpenAI's finish reasons, which vLLM follows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from cbpipe.server.errors import APIError
from cbpipe.server.schemas import ChatCompletionRequest, NamedToolChoice, Tool
from cbpipe.server.structured import Constraint, schema_constraint
from cbpipe.server.tools import ParsedReply, StreamedReply, ToolCall, ToolCallParser, call_of

# A function without parameters takes an empty object, as vLLM forces it.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class StreamedPart:
    """What one streamed chunk of a sample carries: content, and OpenAI's ``tool_calls``
    deltas (a call's first names it and has its id; later ones add to its arguments)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __add__(self, other: StreamedPart) -> StreamedPart:
        return StreamedPart(self.content + other.content, self.tool_calls + other.tool_calls)


class ReplyReader(Protocol):
    """One streamed sample's text, read as it comes."""

    made_calls: bool  # whether any call went out, known once finished

    def feed(self, delta: str) -> StreamedPart: ...

    def finish(self) -> StreamedPart: ...


class ToolUse(Protocol):
    """How a request's replies are constrained and read for calls."""

    @property
    def constraint(self) -> Constraint | None:
        """The structured output that forces the calls, if any."""
        ...

    def read(self, text: str) -> ParsedReply:
        """A whole reply's content and calls."""
        ...

    def reader(self) -> ReplyReader: ...

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The finish reason of a reply that made calls."""
        ...


def tool_use(body: ChatCompletionRequest, parser: ToolCallParser | None) -> ToolUse | None:
    """Whether (and how) this request's replies make tool calls."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        return None
    if choice == "required":
        schema = required_schema(body.tools, parallel)
        return RequiredTools(schema_constraint(schema, "tool_choice"))
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in body.tools if t.function.name == name), None)
        if tool is None:
            param = "tool_choice.function.name"
            message = f"{param} {name!r} is not the name of one of the tools"
            raise APIError(400, message, param=param)
        return NamedTool(name, schema_constraint(_parameters(tool), "tool_choice"))
    if parser is None:
        raise APIError(
            400,
            '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
            '--tool-call-parser (a named function or "required" need neither)',
            param="tool_choice",
        )
    return AutoTools(parser, parallel)


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """vLLM's schema of a "required" reply: an array of one or more calls, each the name of
    one tool and an object of its parameters; at most one with ``parallel_tool_calls``
    false. Each tool's ``$defs`` move to the top, where its ``$ref``s now point."""
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        parameters = dict(_parameters(tool))
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                param = f"tools[{i}].function.parameters"
                raise APIError(
                    400,
                    f'{param} defines "$defs" {name!r} unlike another tool does: tool_choice '
                    '"required" puts every tool\'s $defs in one schema',
                    param=param,
                )
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                # vLLM leaves other keys open; closed, a model cannot wander off into them.
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or NO_PARAMETERS


# --- "auto": a parser finds the calls ----------------------------------------------------


@dataclass(frozen=True)
class AutoTools:
    parser: ToolCallParser
    parallel: bool  # parallel_tool_calls: false keeps a reply's first call only
    constraint: Constraint | None = None

    def read(self, text: str) -> ParsedReply:
        reply = self.parser.parse(text)
        return ParsedReply(reply.content, reply.calls if self.parallel else reply.calls[:1])

    def reader(self) -> ReplyReader:
        return _AutoReader(StreamedReply(self.parser), self.parallel)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" else finish_reason


class _AutoReader:
    """Content as it comes, except what may begin a call; the calls whole at the end."""

    def __init__(self, reply: StreamedReply, parallel: bool) -> None:
        self._reply = reply
        self._parallel = parallel
        self.made_calls = False

    def feed(self, delta: str) -> StreamedPart:
        return StreamedPart(self._reply.feed(delta))

    def finish(self) -> StreamedPart:
        rest, calls = self._reply.finish()
        kept = calls if self._parallel else calls[:1]
        self.made_calls = bool(kept)
        return StreamedPart(rest, [call.as_openai(i) for i, call in enumerate(kept)])


# --- a named function: the reply is its arguments ---------------------------------------


@dataclass(frozen=True)
class NamedTool:
    name: str
    constraint: Constraint

    def read(self, text: str) -> ParsedReply:
        return ParsedReply("", [ToolCall(self.name, text)])

    def reader(self) -> ReplyReader:
        return _NamedReader(self.name)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return finish_reason  # OpenAI's "stop" for a call it was told to make


class _NamedReader:
    """The reply's text as the arguments of one call, as it comes."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.made_calls = False  # the first delta names the function

    def feed(self, delta: str) -> StreamedPart:
        return StreamedPart(tool_calls=[self._delta(delta)]) if delta else StreamedPart()

    def finish(self) -> StreamedPart:
        # A reply without text is still the call it was forced to be.
        return StreamedPart() if self.made_calls else StreamedPart(tool_calls=[self._delta("")])

    def _delta(self, arguments: str) -> dict[str, Any]:
        if self.made_calls:
            return {"index": 0, "function": {"arguments": arguments}}
        self.made_calls = True
        return ToolCall(self._name, arguments).as_openai(0)


# --- "required": an array of calls -----------------------------------------------------


@dataclass(frozen=True)
class RequiredTools:
    constraint: Constraint

    def read(self, text: str) -> ParsedReply:
        """The array's calls; a reply cut off before its first call closed is content."""
        calls = CallArray().feed(text)
        return ParsedReply("" if calls else text, calls)

    def reader(self) -> ReplyReader:
        return _RequiredReader()

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" else finish_reason


class _RequiredReader:
    """Each call whole as soon as its object closes; the text waits, and goes out as
    content only if no call ever closed (as ``RequiredTools.read`` reads it whole)."""

    def __init__(self) -> None:
        self._array = CallArray()
        self._parts: list[str] = []
        self._num_calls = 0
        self.made_calls = False

    def feed(self, delta: str) -> StreamedPart:
        self._parts.append(delta)
        calls = self._array.feed(delta)
        first, self._num_calls = self._num_calls, self._num_calls + len(calls)
        self.made_calls = self._num_calls > 0
        return StreamedPart(tool_calls=[c.as_openai(first + i) for i, c in enumerate(calls)])

    def finish(self) -> StreamedPart:
        return StreamedPart() if self.made_calls else StreamedPart("".join(self._parts))


class CallArray:
    """The calls of a JSON array of ``{"name": ..., "parameters": {...}}`` objects, each as
    soon as its object closes. Every character is looked at once: a long reply streamed in
    many deltas costs what it costs read whole. An item that is no call is passed over."""

    def __init__(self) -> None:
        self._depth = 0  # of brackets and braces, outside strings; the array's items are at 2
        self._in_string = False
        self._escaped = False  # the character before was a backslash, in a string
        self._item: list[str] = []  # the characters of the open item

    def feed(self, text: str) -> list[ToolCall]:
        calls = []
        for char in text:
            depth = self._depth
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
            elif char in "]}":
                self._depth -= 1
            if max(depth, self._depth) >= 2:
                self._item.append(char)
            if depth == 2 and self._depth == 1:  # an item closed
                call = _item_call("".join(self._item))
                self._item.clear()
                if call is not None:
                    calls.append(call)
        return calls


def _item_call(text: str) -> ToolCall | None:
    try:
        return call_of(json.loads(text), ("parameters",))
    except json.JSONDecodeError:
        return None
