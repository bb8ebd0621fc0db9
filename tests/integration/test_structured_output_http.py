"""Structured output through the HTTP server on a real engine (the shared ``http_engine``:
the embedded text model, whose replies are nearly random text): what the ``openai``
package gets for OpenAI's ``response_format``, vLLM's ``structured_outputs`` and
``guided_*`` fields and a forced ``tool_choice`` follows the constraint, and a constraint
the engine cannot compile is a 400 that says what is wrong.

The constraints are small and closed (bounded numbers, no free text) so that the model,
which writes nothing on purpose, always completes them well within ``max_tokens``: every
sample here must end with "stop" (or "tool_calls"), never with a prefix cut at "length".
How each field maps onto the engine's ``StructuredOutput``:
tests/unit/test_structured_output_http.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

from tests.integration.conftest import HTTP_MODEL_NAME

MODEL = HTTP_MODEL_NAME
MAX_TOKENS = 64  # far more than any constraint here needs
MESSAGES: Any = [{"role": "user", "content": "Answer in JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["a", "ok"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
HOUR = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_hour", "parameters": HOUR}},
]
PARAMETERS = {"get_weather": CITY, "get_hour": HOUR}


def follows(value: Any, schema: dict[str, Any]) -> bool:
    """Whether ``value`` follows ``schema``, for the few keywords the schemas here use."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and schema.get("minimum", value) <= value <= schema.get("maximum", value)
        )
    assert kind == "object", schema
    properties = schema["properties"]
    return (
        isinstance(value, dict)
        and set(schema["required"]) <= set(value) <= set(properties)
        and all(follows(item, properties[key]) for key, item in value.items())
    )


def test_the_validator_can_say_no() -> None:
    assert follows({"a": 5, "ok": True}, SCHEMA)
    for value in ({"a": 5}, {"a": 1000, "ok": True}, {"a": True, "ok": True},
                  {"a": 5, "ok": 1}, {"a": 5, "ok": True, "b": 0}, [5]):  # fmt: skip
        assert not follows(value, SCHEMA), value


# --- JSON ----------------------------------------------------------------------------------


def test_a_json_schema_response_format_gives_json_of_the_schema(api: openai.OpenAI) -> None:
    # Sampled, not greedy: JSON may have any whitespace between its tokens (vLLM's default),
    # and this model, greedy, writes spaces until the limit once it starts.
    reply = api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=4,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    assert len(reply.choices) == 4
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        text = choice.message.content or ""
        assert follows(json.loads(text), SCHEMA), text


def test_json_without_whitespace_streamed_and_whole(api: openai.OpenAI) -> None:
    kwargs: Any = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    }
    whole = api.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop"
    text = whole.message.content or ""
    assert follows(json.loads(text), SCHEMA) and not re.search(r"\s", text), text
    chunks = list(api.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "extra_body",
    [{"guided_json": json.dumps(SCHEMA)}, {"response_format": {"type": "json_schema",
      "json_schema": {"name": "answer", "schema": SCHEMA}}}],
)  # fmt: skip
def test_completions_take_a_schema_too(api: openai.OpenAI, extra_body: dict[str, Any]) -> None:
    reply = api.completions.create(
        model=MODEL, prompt="The answer:", max_tokens=MAX_TOKENS, temperature=1.0, seed=1, n=4,
        extra_body=extra_body,
    )  # fmt: skip
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and follows(json.loads(choice.text), SCHEMA)


def test_a_json_object_response_format_gives_an_object(api: openai.OpenAI) -> None:
    # Any object: this model fills one with text it may not finish, so a sample cut at the
    # limit is the start of one; those that end by themselves parse.
    reply = api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2 * MAX_TOKENS, temperature=1.0, seed=1,
        n=4, response_format={"type": "json_object"},
    )  # fmt: skip
    finished = [c.message.content or "" for c in reply.choices if c.finish_reason == "stop"]
    assert finished, reply.choices
    for text in finished:
        assert isinstance(json.loads(text), dict), text
    for choice in reply.choices:
        assert (choice.message.content or "").lstrip().startswith("{"), choice


# --- choices, regular expressions, grammars -------------------------------------------------


def test_a_choice_is_one_of_the_choices(api: openai.OpenAI) -> None:
    choices = ["yes", "no", "maybe later"]
    reply = api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=1, n=8,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    for choice in reply.choices:
        assert choice.message.content in choices and choice.finish_reason == "stop", choice
    completion = api.completions.create(
        model=MODEL, prompt="Yes or no?", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert completion.choices[0].text in choices


@pytest.mark.parametrize("stream", [False, True])
def test_a_regex_is_matched_whole(api: openai.OpenAI, stream: bool) -> None:
    pattern = r"[0-9]{3}-[a-c]{2}"
    kwargs: Any = {
        "model": MODEL, "prompt": "Code:", "max_tokens": MAX_TOKENS, "temperature": 1.0,
        "seed": 7, "n": 4, "extra_body": {"guided_regex": pattern},
    }  # fmt: skip
    if stream:
        texts = ["", "", "", ""]
        finishes: list[str | None] = [None] * 4
        for chunk in api.completions.create(**kwargs, stream=True):
            for part in chunk.choices:
                texts[part.index] += part.text
                finishes[part.index] = part.finish_reason or finishes[part.index]
    else:
        reply = api.completions.create(**kwargs)
        texts = [c.text for c in reply.choices]
        finishes = [c.finish_reason for c in reply.choices]
    assert finishes == ["stop"] * 4
    for text in texts:
        assert re.fullmatch(pattern, text), text


def test_a_grammar_is_followed(api: openai.OpenAI) -> None:
    grammar = 'start: "(" num ("," num)? ")"\nnum: /[1-9]/'
    reply = api.completions.create(
        model=MODEL, prompt="A pair:", max_tokens=MAX_TOKENS, temperature=1.0, seed=2, n=4,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )  # fmt: skip
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert re.fullmatch(r"\([1-9](,[1-9])?\)", choice.text), choice.text


# --- what the engine refuses ----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"guided_regex": "[0-9"}, "guided_regex", ["regex"]),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}},
         "structured_outputs.grammar", ["grammar"]),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema", ["json"]),
    ],
)  # fmt: skip
def test_a_constraint_the_engine_cannot_compile_is_a_400_saying_what_is_wrong(
    http: httpx.Client, stream: bool, body: dict[str, Any], param: str, words: list[str]
) -> None:
    prompts = {"/v1/completions": {"prompt": "x"}, "/v1/chat/completions": {"messages": MESSAGES}}
    for path, prompt in prompts.items():
        response = http.post(path, json=prompt | body | {"max_tokens": 8, "stream": stream})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param, error
        assert all(word in error["message"].lower() for word in words), error


def test_the_openai_package_sees_a_bad_regex_as_a_bad_request(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8,
            extra_body={"structured_outputs": {"regex": "(unclosed"}},
        )  # fmt: skip
    assert raised.value.status_code == 400
    assert "regex" in str(raised.value.message).lower()


# --- forced tool calls ----------------------------------------------------------------------


def test_a_named_function_is_called_with_arguments_of_its_schema(api: openai.OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_hour"}}
    kwargs: Any = {
        "model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": named,
        "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 4,
    }  # fmt: skip
    (choice,) = api.chat.completions.create(**kwargs).choices
    assert choice.finish_reason == "stop"  # OpenAI's and vLLM's, for a named function
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_hour"
    assert follows(json.loads(call.function.arguments), HOUR), call.function.arguments
    # Streamed (the same seed: the same tokens), the arguments come in pieces that make the
    # same call.
    chunks = list(api.chat.completions.create(**kwargs, stream=True))
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert calls[0].function is not None and calls[0].function.name == "get_hour"
    assert calls[0].id and all(c.index == 0 for c in calls)
    arguments = "".join((c.function.arguments or "") if c.function else "" for c in calls)
    assert arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_required_makes_calls_of_the_tools(api: openai.OpenAI, stream: bool) -> None:
    kwargs: Any = {
        "model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
        "max_tokens": 4 * MAX_TOKENS, "temperature": 1.0, "seed": 5, "n": 3,
    }  # fmt: skip
    if stream:
        found: dict[int, dict[int, list[str]]] = {}  # choice -> call index -> name, arguments
        finishes = {}
        for chunk in api.chat.completions.create(**kwargs, stream=True):
            for part in chunk.choices:
                for delta in part.delta.tool_calls or []:
                    assert delta.function is not None
                    entry = found.setdefault(part.index, {}).setdefault(delta.index, ["", ""])
                    entry[0] = delta.function.name or entry[0]  # in a call's first delta
                    entry[1] += delta.function.arguments or ""
                if part.finish_reason is not None:
                    finishes[part.index] = part.finish_reason
        calls = {i: [tuple(found[i][k]) for k in sorted(found[i])] for i in found}
    else:
        reply = api.chat.completions.create(**kwargs)
        finishes = {c.index: c.finish_reason for c in reply.choices}
        calls = {
            c.index: [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
            for c in reply.choices
        }
    assert finishes == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    for index in range(3):
        assert calls[index], index
        for name, arguments in calls[index]:
            assert follows(json.loads(arguments), PARAMETERS[name]), (name, arguments)


def test_required_without_parallel_calls_makes_one(api: openai.OpenAI) -> None:
    reply = api.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1.0, seed=9, n=4,
    )  # fmt: skip
    for choice in reply.choices:
        (call,) = choice.message.tool_calls or []
        assert call.type == "function"
        assert follows(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        assert choice.finish_reason == "tool_calls"
