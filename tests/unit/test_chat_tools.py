"""Tool calls through the chat endpoint, in-process: the app with a scripted engine that
answers every job with a given text, so that replies with calls can be tested (the embedded
model never writes one). The parsers themselves: test_tool_calls.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.testclient import TestClient

from cbpipe.client import Delta, Result
from cbpipe.models import EMBEDDED_MODEL_DIR
from cbpipe.protocol.sampling import SamplingParams
from cbpipe.server.app import build_app
from cbpipe.server.common import ServerState
from cbpipe.server.metrics import ServerMetrics
from cbpipe.server.text import Text
from cbpipe.server.tools import HermesParser

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
TOOLS = [{"type": "function", "function": WEATHER}]


@dataclass
class ScriptedJob:
    """A job whose every sample writes ``pieces``, one delta each, then stops."""

    params: SamplingParams
    pieces: list[str]
    prompt_logprobs: None = None

    async def delta_batches(self) -> AsyncIterator[list[Delta]]:
        for sample in range(self.params.n):
            for i, piece in enumerate(self.pieces):
                yield [Delta(sample, [100 + i], piece)]
            yield [Delta(sample, [], "", finish_reason="stop")]

    async def results(self) -> list[Result]:
        text = "".join(self.pieces)
        return [Result(list(range(100, 100 + len(self.pieces))), text, "stop", 5, index=i)
                for i in range(self.params.n)]  # fmt: skip

    def cancel_nowait(self) -> None:
        pass


@dataclass
class ScriptedEngine:
    """What ``Generation`` and the routes use of ``AsyncClient``."""

    pieces: list[str]
    prompts: list[list[int]] = field(default_factory=list)
    max_model_len: int = 2048
    vocab_size: int = 2048

    def submit(self, prompt: list[int], *, max_new_tokens: int, **options: Any) -> ScriptedJob:
        self.prompts.append(list(prompt))
        return ScriptedJob(SamplingParams(max_new_tokens, n=options.get("n", 1)), self.pieces)


@pytest.fixture(scope="module")
def text() -> Text:
    return Text.load(EMBEDDED_MODEL_DIR, "m", TEMPLATE)


def app_for(text: Text, pieces: list[str], tools: bool = True) -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(pieces)
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
        ({"tool_choice": "required"}, True, "tool_choice", "cannot force"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, True,
         "tool_choice", "cannot force"),
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
