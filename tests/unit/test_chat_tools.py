"""Tool calls through the chat endpoint, in-process: the app with a scripted engine that
answers every job with a given text, so that replies with calls can be tested (the embedded
model never writes one), and keeps the structured output a forced call asks of it. The
parsers themselves: test_tool_calls.py; the forced calls on a real engine:
tests/integration/test_structured_output_http.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from cbpipe.models import EMBEDDED_MODEL_DIR
from cbpipe.server.app import build_app
from cbpipe.server.common import ServerState
from cbpipe.server.metrics import ServerMetrics
from cbpipe.server.text import Text
from cbpipe.server.tools import HermesParser
from tests.unit.scripted_server import ScriptedEngine

TEMPLATE = (
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"name": "get_weather", "description": "Weather", "parameters": CITY}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
TOOLS = [{"type": "function", "function": WEATHER}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def text() -> Text:
    return Text.load(EMBEDDED_MODEL_DIR, "m", TEMPLATE)


def app_for(
    text: Text, pieces: list[str], tools: bool = True, finish_reason: str = "stop"
) -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(pieces, finish_reason)
    state = ServerState(engine, text, ServerMetrics("m"), "m",  # type: ignore[arg-type]
                        tool_parser=HermesParser() if tools else None)  # fmt: skip
    return TestClient(build_app(state)), engine


def chat(client: TestClient, **fields: Any) -> Any:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS} | fields
    return client.post("/v1/chat/completions", json=body)


def test_a_reply_with_a_call_is_a_tool_call_message(text: Text) -> None:
    client, engine = app_for(text, ["Let me check. ", CALL[:30], CALL[30:]])
    reply = chat(client).json()
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # The template saw the tools.
    assert '"name": "get_weather"' in text.decode(engine.prompts[0])


def test_a_streamed_call_comes_whole_with_the_last_chunk(text: Text) -> None:
    client, _ = app_for(text, ["Let me check. <tool", CALL[len("<tool") :]])
    with client.stream("POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "stream": True,
    }) as response:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check. "
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_plain_reply_and_tool_choice_none_are_content(text: Text) -> None:
    client, _ = app_for(text, ["It is ", "sunny."])
    message = chat(client).json()["choices"][0]["message"]
    assert message["content"] == "It is sunny." and "tool_calls" not in message
    client, _ = app_for(text, [CALL])
    choice = chat(client, tool_choice="none").json()["choices"][0]
    assert choice["message"]["content"] == CALL and choice["finish_reason"] == "stop"


def test_parallel_tool_calls_false_keeps_the_first(text: Text) -> None:
    client, _ = app_for(text, [CALL, CALL.replace("Paris", "Rome")])
    message = chat(client).json()["choices"][0]["message"]
    assert len(message["tool_calls"]) == 2
    message = chat(client, parallel_tool_calls=False).json()["choices"][0]["message"]
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"city": "Paris"}
    ]


def test_a_conversation_with_calls_and_their_answers_reaches_the_template(text: Text) -> None:
    client, engine = app_for(text, ["Sunny."])
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ]  # fmt: skip
    assert chat(client, messages=messages).status_code == 200
    prompt = text.decode(engine.prompts[0])
    assert '"arguments": {"city": "Paris"}' in prompt  # an object for the template
    assert "<|tool|>21 C, sunny[call_1]" in prompt


@pytest.mark.parametrize(
    ("fields", "tools", "param", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, False,
         "tool_choice.function.name", "'get_time' is not the name of one of the tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, False,
         "response_format", "tool_choice and response_format both constrain the output"),
        ({"tool_choice": NAMED, "structured_outputs": {"regex": "a+"}}, False,
         "structured_outputs.regex", "tool_choice and structured_outputs.regex both"),
        ({"tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"$defs": {
             "city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "g", "parameters": {"$defs": {
             "city": {"type": "integer"}}}}}]}, False,
         "tools[1].function.parameters", '"$defs" \'city\' unlike another tool'),
        ({"tools": None, "tool_choice": "auto"}, True, "tool_choice", "needs tools"),
        ({}, False, "tool_choice", "--enable-auto-tool-choice"),
        ({"tool_choice": "sometimes"}, True, "tool_choice", "'none', 'auto' or 'required'"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
          "function": {"name": "f", "arguments": "[1]"}}]}]}, True,
         "messages[0].tool_calls[0].function.arguments", "must be a JSON object"),
        ({"messages": [{"role": "tool", "content": "21 C"}]}, True,
         "messages[0].tool_call_id", "is required"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, True,
         "messages[0].tool_call_id", "tool messages only"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c",
          "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, True,
         "messages[0].tool_calls", "assistant messages only"),
    ],
)  # fmt: skip
def test_tool_requests_cbpipe_cannot_honour_are_400s(
    text: Text, fields: dict[str, Any], tools: bool, param: str, message: str
) -> None:
    client, _ = app_for(text, ["x"], tools=tools)
    response = chat(client, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_tokenize_renders_the_tools_as_chat_does(text: Text) -> None:
    client, engine = app_for(text, ["x"])
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    counted = client.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert chat(client, messages=messages).status_code == 200
    assert counted["tokens"] == engine.prompts[0]


# --- forced calls: a named function, "required" --------------------------------------------

ARGUMENTS = '{"city": "Paris {\\"Ile\\"}"}'  # braces and escaped quotes inside a string
REQUIRED_REPLY = (
    f'[{{"name": "get_weather", "parameters": {ARGUMENTS}}},\n'
    ' {"name": "get_time", "parameters": {}}]'
)
BOTH_TOOLS = [*TOOLS, {"type": "function", "function": TIME}]


def stream_chunks(client: TestClient, **fields: Any) -> list[dict[str, Any]]:
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS} | fields
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: {")]  # fmt: skip


def test_a_named_function_forces_its_parameters_and_the_reply_is_its_call(text: Text) -> None:
    # No --enable-auto-tool-choice: a forced call needs no parser, as in vLLM.
    client, engine = app_for(text, [ARGUMENTS[:9], ARGUMENTS[9:]], tools=False)
    (choice,) = chat(client, tool_choice=NAMED).json()["choices"]
    output = engine.params[0].structured_output
    assert output is not None and json.loads(output.json or "") == CITY
    assert choice["finish_reason"] == "stop"  # OpenAI's and vLLM's for a named function
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS}
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")


def test_a_named_function_streams_its_arguments_as_they_come(text: Text) -> None:
    pieces = [ARGUMENTS[:5], ARGUMENTS[5:12], ARGUMENTS[12:]]
    client, _ = app_for(text, pieces, tools=False)
    chunks = stream_chunks(client, tool_choice=NAMED, n=2)
    for index in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == index]
        calls = [call for d in deltas for call in d.get("tool_calls", [])]
        assert [call["function"]["arguments"] for call in calls] == pieces
        assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
        assert all(call["index"] == 0 for call in calls)
        assert all("id" not in call and "name" not in call["function"] for call in calls[1:])
        assert not any(d.get("content") for d in deltas)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes.count("stop") == 2 and set(finishes) == {None, "stop"}


def test_a_named_function_without_parameters_forces_an_empty_object(text: Text) -> None:
    client, engine = app_for(text, ["{}"], tools=False)
    tools = [{"type": "function", "function": {"name": "now"}}]
    named = {"type": "function", "function": {"name": "now"}}
    (choice,) = chat(client, tools=tools, tool_choice=named).json()["choices"]
    output = engine.params[0].structured_output
    assert output is not None and json.loads(output.json or "") == {
        "type": "object",
        "properties": {},
    }
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}


def test_required_forces_an_array_of_calls_of_the_tools(text: Text) -> None:
    client, engine = app_for(text, [REQUIRED_REPLY], tools=False)
    (choice,) = chat(client, tools=BOTH_TOOLS, tool_choice="required").json()["choices"]
    output = engine.params[0].structured_output
    assert output is not None
    schema = json.loads(output.json or "")
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"] for o in options] == [
        {"type": "string", "enum": ["get_weather"]},
        {"type": "string", "enum": ["get_time"]},
    ]
    assert [o["properties"]["parameters"] for o in options] == [CITY, TIME["parameters"]]
    # Each an object: without "type", JSON Schema lets any non-object through (true, 0).
    assert all(o["type"] == "object" for o in options)
    assert all(o["required"] == ["name", "parameters"] for o in options)
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    calls = [call["function"] for call in choice["message"]["tool_calls"]]
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in calls] == [json.loads(ARGUMENTS), {}]


def test_required_streams_each_call_when_its_object_closes(text: Text) -> None:
    close = REQUIRED_REPLY.index("},\n") + 1  # the first call's object ends here
    pieces = [REQUIRED_REPLY[:20], REQUIRED_REPLY[20:close], REQUIRED_REPLY[close:-3], "}]"]
    client, _ = app_for(text, [*pieces[:-1], REQUIRED_REPLY[-3], pieces[-1]], tools=False)
    chunks = stream_chunks(client, tools=BOTH_TOOLS, tool_choice="required")
    calls_by_chunk = [c["choices"][0]["delta"].get("tool_calls", []) for c in chunks]
    assert [len(calls) for calls in calls_by_chunk] == [0, 1, 0, 0, 1, 0]
    first, second = calls_by_chunk[1][0], calls_by_chunk[4][0]
    assert (first["index"], first["function"]["name"]) == (0, "get_weather")
    assert json.loads(first["function"]["arguments"]) == json.loads(ARGUMENTS)
    assert (second["index"], second["function"]["name"]) == (1, "get_time")
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_required_without_parallel_calls_allows_one(text: Text) -> None:
    client, engine = app_for(text, ['[{"name": "get_time", "parameters": {}}]'], tools=False)
    reply = chat(client, tools=BOTH_TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(reply.json()["choices"][0]["message"]["tool_calls"]) == 1
    output = engine.params[0].structured_output
    assert output is not None and json.loads(output.json or "")["maxItems"] == 1


def test_required_moves_the_tools_defs_to_the_top(text: Text) -> None:
    client, engine = app_for(text, ["[]"], tools=False)
    parameters = {"type": "object", "properties": {"at": {"$ref": "#/$defs/place"}},
                  "$defs": {"place": {"type": "string"}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "go", "parameters": parameters}}]
    assert chat(client, tools=tools, tool_choice="required").status_code == 200
    output = engine.params[0].structured_output
    assert output is not None
    schema = json.loads(output.json or "")
    assert schema["$defs"] == {"place": {"type": "string"}}
    (option,) = schema["items"]["anyOf"]
    assert "$defs" not in option["properties"]["parameters"]
    assert parameters["$defs"] == {"place": {"type": "string"}}  # the request is left as it was


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_reply_cut_short_keeps_the_calls_that_closed(text: Text, stream: bool) -> None:
    cut = REQUIRED_REPLY[: REQUIRED_REPLY.index("get_time")]
    client, _ = app_for(text, [cut], tools=False, finish_reason="length")
    fields = {"tools": BOTH_TOOLS, "tool_choice": "required"}
    if stream:
        deltas = [c["choices"][0]["delta"] for c in stream_chunks(client, **fields)]
        calls = [call for d in deltas for call in d.get("tool_calls", [])]
        content = "".join(d.get("content") or "" for d in deltas)
    else:
        message = chat(client, **fields).json()["choices"][0]["message"]
        calls, content = message["tool_calls"], message["content"] or ""
    assert [call["function"]["name"] for call in calls] == ["get_weather"]
    assert content == ""
    # Cut before any call closed: the text is the reply, as content.
    client, _ = app_for(text, [cut[:30]], tools=False, finish_reason="length")
    if stream:
        deltas = [c["choices"][0]["delta"] for c in stream_chunks(client, **fields)]
        assert "".join(d.get("content") or "" for d in deltas) == cut[:30]
        assert not any(d.get("tool_calls") for d in deltas)
    else:
        (choice,) = chat(client, **fields).json()["choices"]
        assert choice["message"]["content"] == cut[:30] and "tool_calls" not in choice["message"]
        assert choice["finish_reason"] == "length"


def test_the_engines_refusal_of_a_tools_schema_names_tool_choice(text: Text) -> None:
    client, engine = app_for(text, ["x"], tools=False)
    engine.refusal = "invalid structured_output.json: unknown keyword"
    response = chat(client, tool_choice=NAMED)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and "unknown keyword" in error["message"]
