"""Tool calls found in a chat reply, whole and as it streams: the parsers of "auto" tool
choice, and the array of calls a "required" one forces."""

from __future__ import annotations

import json

import pytest

from cbpipe.server.tool_choice import CallArray
from cbpipe.server.tools import (
    HermesParser,
    Llama3JsonParser,
    ParsedReply,
    StreamedReply,
    ToolCall,
    ToolCallParser,
)

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "C"}))
TIME = ToolCall("get_time", json.dumps({"zone": "CET"}))


def content_only(*texts: str) -> list[tuple[str, ParsedReply]]:
    return [(text, ParsedReply(text, [])) for text in texts]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Sunny, 21 degrees.", ParsedReply("Sunny, 21 degrees.", [])),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
         "</tool_call>", ParsedReply("", [WEATHER])),
        ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
         '"unit": "C"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": '
         '{"zone": "CET"}}</tool_call>', ParsedReply("Let me look.\n", [WEATHER, TIME])),
        # Arguments as a JSON string, and a last call the model ended without its closing tag.
        ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}',
         ParsedReply("", [TIME])),
        # What cannot be read whole is content: bad JSON, no name, text after the calls.
        *content_only("<tool_call>{not json}</tool_call>",
                      '<tool_call>{"arguments": {}}</tool_call>',
                      '<tool_call>{"name": "f", "arguments": {}}</tool_call> and more'),
    ],
)  # fmt: skip
def test_hermes_replies(text: str, expected: ParsedReply) -> None:
    assert HermesParser().parse(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The weather is fine.", ParsedReply("The weather is fine.", [])),
        (' {"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
         ParsedReply("", [WEATHER])),
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
         '{"name": "get_time", "arguments": {"zone": "CET"}}', ParsedReply("", [WEATHER, TIME])),
        *content_only('{"name": "get_weather", "parameters": {"city": "Par', '{"answer": 42}'),
    ],
)  # fmt: skip
def test_llama3_json_replies(text: str, expected: ParsedReply) -> None:
    assert Llama3JsonParser().parse(text) == expected


def stream(parser: ToolCallParser, pieces: list[str]) -> tuple[list[str], list[ToolCall]]:
    reply = StreamedReply(parser)
    sent = [reply.feed(piece) for piece in pieces]
    rest, calls = reply.finish()
    return [*sent, rest], calls


def test_streamed_content_holds_back_only_what_may_start_a_call() -> None:
    call = '{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    pieces = ["Let me", " look.<tool", "_call>", call[:20], call[20:]]
    sent, calls = stream(HermesParser(), pieces)
    assert sent == ["Let me", " look.", "", "", "", ""]
    assert calls == [TIME]
    # "<" that turned out not to start a call goes out when the text moves past it.
    sent, calls = stream(HermesParser(), ["a <", "b> c"])
    assert sent == ["a ", "<b> c", ""] and calls == []


def test_a_streamed_reply_that_only_looked_like_a_call_is_sent_whole() -> None:
    sent, calls = stream(HermesParser(), ["Hi <tool_call>{broken", " json"])
    assert "".join(sent) == "Hi <tool_call>{broken json" and calls == []
    sent, calls = stream(Llama3JsonParser(), ["  ", '{"answer"', ": 42}"])
    assert sent == ["", "", "", '  {"answer": 42}'] and calls == []
    sent, calls = stream(Llama3JsonParser(), ["Plain", " text"])
    assert sent == ["Plain", " text", ""] and calls == []


def test_calls_in_openai_shape() -> None:
    call = WEATHER.as_openai(index=0)
    assert call["index"] == 0 and call["type"] == "function"
    assert call["id"].startswith("chatcmpl-tool-") and call["id"] != WEATHER.as_openai()["id"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "C"}


ARRAY = (
    '[ {"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}},'
    '{"name": "get_time", "parameters": {"zone": "CET"}} ]'
)


def test_a_required_array_gives_each_call_when_its_object_closes() -> None:
    assert CallArray().feed(ARRAY) == [WEATHER, TIME]
    # One character at a time: each call comes with the brace that closes its object.
    array = CallArray()
    found = [(i, calls) for i, char in enumerate(ARRAY) if (calls := array.feed(char))]
    first_end = ARRAY.index("}},") + 1
    assert found == [(first_end, [WEATHER]), (len(ARRAY) - 3, [TIME])]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Brackets, braces, quotes and backslashes inside strings are text.
        ('[{"name": "f", "parameters": {"s": "}]{[\\"\\\\"}}]',
         [ToolCall("f", json.dumps({"s": '}]{["\\'}))]),
        ('[{"name": "f"}]', [ToolCall("f", "{}")]),  # no parameters: none
        ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b',
         [ToolCall("f", '{"a": 1}')]),  # cut off: the calls that closed
        ('[{"parameters": {}}, {"name": "g", "parameters": []}]', []),  # not calls
        ("[]", []),
        ("", []),
    ],
)  # fmt: skip
def test_required_arrays(text: str, expected: list[ToolCall]) -> None:
    assert CallArray().feed(text) == expected
