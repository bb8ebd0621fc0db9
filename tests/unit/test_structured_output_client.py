"""``structured_output=`` as the client takes it: a ``StructuredOutput``, or a mapping as
vLLM's ``structured_outputs`` is written; what reaches the engine, and the errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cbpipe.client import RequestError, StructuredOutput
from cbpipe.client.jobs import make_params
from cbpipe.protocol.messages import Submit, decode, encode

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, None),
        (StructuredOutput(regex="[0-9]+"), StructuredOutput(regex="[0-9]+")),
        ({"json": SCHEMA}, StructuredOutput(json=json.dumps(SCHEMA))),
        ({"json": '{"type": "string"}'}, StructuredOutput(json='{"type": "string"}')),
        ({"json_object": True}, StructuredOutput(json_object=True)),
        ({"choice": ["yes", "no"]}, StructuredOutput(choice=("yes", "no"))),
        ({"grammar": 'start: "a"', "regex": None}, StructuredOutput(grammar='start: "a"')),
        ({"regex": "a+", "disable_any_whitespace": True},
         StructuredOutput(regex="a+", disable_any_whitespace=True)),
    ],
)  # fmt: skip
def test_structured_output_reaches_the_engine(given: Any, expected: Any) -> None:
    params = make_params(8, {"structured_output": given})
    assert params.structured_output == expected
    decoded = decode(encode(Submit(1, [1, 2], params)))
    assert isinstance(decoded, Submit) and decoded.params.structured_output == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"json": SCHEMA, "regex": "a"}, "exactly one of json, json_object, regex, choice"),
        ({}, "got none"),
        ({"schema": SCHEMA}, "structured_output has no field 'schema'; its fields are json,"),
        ({"json": {"a": object()}}, "structured_output.json is no JSON schema"),
        ({"choice": []}, "at least one choice"),
        ({"regex": ""}, "structured_output.regex must be a non-empty string"),
        ("[0-9]+", "must be a StructuredOutput or a mapping of its fields, got str"),
    ],
)
def test_a_bad_structured_output_is_a_request_error(given: Any, message: str) -> None:
    with pytest.raises(RequestError, match=message.replace("(", r"\(")):
        make_params(8, {"structured_output": given})
