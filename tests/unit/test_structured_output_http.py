"""Structured output asked for over HTTP, in-process against a scripted engine: what each
request field (OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_*``)
makes of a request's ``StructuredOutput``, and the 400s of malformed, conflicting or
refused ones. Forced tool calls: test_chat_tools.py; a real engine:
tests/integration/test_structured_output_http.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from cbpipe.models import EMBEDDED_MODEL_DIR
from cbpipe.protocol.sampling import MAX_STRUCTURED_CHARS, StructuredOutput
from cbpipe.server.app import build_app
from cbpipe.server.common import ServerState
from cbpipe.server.metrics import ServerMetrics
from cbpipe.server.text import Text
from tests.unit.scripted_server import ScriptedEngine

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "A number?"}]
ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]


@pytest.fixture(scope="module")
def text() -> Text:
    return Text.load(EMBEDDED_MODEL_DIR, "m", TEMPLATE)


def app_for(text: Text, refusal: str | None = None) -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(['{"a": 1', "}"], refusal=refusal)
    state = ServerState(engine, text, ServerMetrics("m"), "m")  # type: ignore[arg-type]
    return TestClient(build_app(state)), engine


def post(client: TestClient, path: str, **fields: Any) -> Any:
    body = {"prompt": "A number:"} if path == "/v1/completions" else {"messages": MESSAGES}
    return client.post(path, json=body | {"max_tokens": 8} | fields)


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {
          "name": "a", "schema": SCHEMA, "strict": True, "description": "An a"}}},
         StructuredOutput(json=json.dumps(SCHEMA))),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(json=json.dumps(SCHEMA))),
        ({"structured_outputs": {"json": '{"type": "string"}'}},
         StructuredOutput(json='{"type": "string"}')),  # text is sent as written
        ({"structured_outputs": {"json_object": True}}, StructuredOutput(json_object=True)),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredOutput(regex="[0-9]{3}")),
        ({"structured_outputs": {"choice": ["yes", "no"]}},
         StructuredOutput(choice=("yes", "no"))),
        ({"structured_outputs": {"grammar": 'start: "a"+'}},
         StructuredOutput(grammar='start: "a"+')),
        ({"structured_outputs": {"json": SCHEMA, "json_object": False,
                                 "disable_any_whitespace": True}},
         StructuredOutput(json=json.dumps(SCHEMA), disable_any_whitespace=True)),
        ({"guided_json": SCHEMA}, StructuredOutput(json=json.dumps(SCHEMA))),
        ({"guided_regex": "[0-9]{3}"}, StructuredOutput(regex="[0-9]{3}")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput(choice=("yes", "no"))),
        ({"guided_grammar": 'start: "a"+'}, StructuredOutput(grammar='start: "a"+')),
        ({}, None),
    ],
)  # fmt: skip
def test_each_field_reaches_the_engine_as_one_structured_output(
    text: Text, path: str, fields: dict[str, Any], expected: StructuredOutput | None
) -> None:
    client, engine = app_for(text)
    response = post(client, path, **fields)
    assert response.status_code == 200, response.text
    (params,) = engine.params
    assert params.structured_output == expected


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        # Two constraints on one text.
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
         "response_format and guided_regex both constrain the output"),
        ({"structured_outputs": {"choice": ["a"]}, "guided_choice": ["a"]}, "guided_choice",
         "structured_outputs.choice and guided_choice both"),
        ({"structured_outputs": {"regex": "a", "grammar": "start: a"}}, "structured_outputs",
         "takes exactly one of json, json_object, regex, choice, grammar; got regex, grammar"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs", "got none"),
        # Malformed ones, named where they are.
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
         'is required with type "json_schema"'),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
         "response_format.json_schema.schema", "is required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
         "response_format.json_schema.name", "is required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a",
          "schema": "{}"}}}, "response_format.json_schema.schema", "valid dictionary"),
        ({"response_format": {"type": "json_object", "json_schema": {"name": "a",
          "schema": SCHEMA}}}, "response_format.json_schema", 'type "json_schema" only'),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type",
         "'text', 'json_object' or 'json_schema'"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json",
         "is not valid JSON"),
        ({"guided_json": "[1, 2]"}, "guided_json", "must be a JSON schema (an object), got list"),
        ({"guided_json": "true"}, "guided_json", "must be a JSON schema (an object), got bool"),
        ({"guided_json": 5}, "guided_json", "a JSON schema: an object, or its JSON text"),
        ({"guided_regex": ""}, "guided_regex", "must be a non-empty regular expression"),
        ({"guided_regex": "a" * (MAX_STRUCTURED_CHARS + 1)}, "guided_regex",
         f"at most {MAX_STRUCTURED_CHARS} are allowed"),
        ({"guided_grammar": ""}, "guided_grammar", "must be a non-empty grammar"),
        ({"guided_choice": []}, "guided_choice", "at least one choice"),
        ({"guided_choice": "yes"}, "guided_choice", "valid list"),
        ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice",
         "structured_outputs.choice[1] is empty"),
        ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}},
         "structured_outputs.backend", "is not supported by cbpipe"),
        ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"},
         "guided_decoding_backend", "is not supported by cbpipe"),
    ],
)  # fmt: skip
def test_malformed_or_conflicting_constraints_are_400s_naming_the_field(
    text: Text, path: str, fields: dict[str, Any], param: str, message: str
) -> None:
    client, engine = app_for(text)
    response = post(client, path, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert message in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert engine.params == []  # refused before the engine saw it


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "[0-9"}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a",
          "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
        ({"structured_outputs": {"grammar": "start: ?"}}, "structured_outputs.grammar"),
    ],
)  # fmt: skip
def test_the_engines_refusal_is_a_400_with_its_message_naming_the_field(
    text: Text, path: str, stream: bool, fields: dict[str, Any], param: str
) -> None:
    refusal = "invalid structured_output.regex: unclosed character class"
    client, _ = app_for(text, refusal=refusal)
    response = post(client, path, stream=stream, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "message": refusal,
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }
