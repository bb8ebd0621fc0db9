"""Structured output asked for over HTTP: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar``, each read into the one ``StructuredOutput`` the engine compiles (with
llguidance) and samples in.

One request gets one constraint. Two (``response_format`` and ``guided_regex``, say, or a
forced tool call beside a schema) are a 400 that names both, where vLLM lets one overwrite
the other without a word. Here the shapes are checked and a JSON schema's text is parsed;
whether a schema, a regular expression or a grammar means anything is the engine's to say,
and its refusal comes back as a 400 naming the field (``errors.from_engine``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from cbpipe.protocol.sampling import MAX_CHOICES, MAX_STRUCTURED_CHARS, StructuredOutput
from cbpipe.server.errors import APIError
from cbpipe.server.schemas import ResponseFormat, StructuredOutputs, _SamplingFields

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# vLLM's older fields, each one kind of constraint.
_GUIDED = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)


@dataclass(frozen=True)
class Constraint:
    """A request's structured output, and the field that asked for it: an error about it
    names that field."""

    output: StructuredOutput
    param: str


def requested_constraint(request: _SamplingFields) -> Constraint | None:
    """The constraint a request's structured-output fields ask for, if any; a 400 for a
    malformed one or for more than one."""
    guided = [
        _BUILDERS[kind](value, name)
        for name, kind in _GUIDED
        if (value := getattr(request, name)) is not None
    ]
    return only_one(
        [
            _from_response_format(request.response_format),
            _from_structured_outputs(request.structured_outputs),
            *guided,
        ]
    )


def only_one(constraints: list[Constraint | None]) -> Constraint | None:
    """The one constraint given, or None; two are a 400 naming both."""
    given = [c for c in constraints if c is not None]
    if len(given) > 1:
        first, second = given[0].param, given[1].param
        raise APIError(
            400,
            f"{first} and {second} both constrain the output, and a request takes one "
            "structured output: leave one out",
            param=second,
        )
    return given[0] if given else None


def schema_constraint(schema: dict[str, Any], param: str) -> Constraint:
    """JSON following ``schema`` (a forced tool call's, say), blamed on ``param``."""
    return _json(schema, param)


def _from_response_format(given: ResponseFormat | None) -> Constraint | None:
    if given is None:
        return None
    if given.type != "json_schema":
        if given.json_schema is not None:
            param = "response_format.json_schema"
            raise APIError(400, f'{param} belongs to type "json_schema" only', param=param)
        if given.type == "text":
            return None
        return _checked(StructuredOutput(json_object=True), "response_format")
    if given.json_schema is None:
        param = "response_format.json_schema"
        raise APIError(400, f'{param} is required with type "json_schema"', param=param)
    return _json(given.json_schema.schema_, "response_format.json_schema.schema")


def _from_structured_outputs(given: StructuredOutputs | None) -> Constraint | None:
    if given is None:
        return None
    values = {
        "json": given.json_,
        "json_object": given.json_object or None,  # false asks for nothing
        "regex": given.regex,
        "choice": given.choice,
        "grammar": given.grammar,
    }
    found = [kind for kind, value in values.items() if value is not None]
    if len(found) != 1:
        raise APIError(
            400,
            f"structured_outputs takes exactly one of {', '.join(_KINDS)}; got "
            f"{', '.join(found) or 'none'}",
            param="structured_outputs",
        )
    (kind,) = found
    param = f"structured_outputs.{kind}"
    if kind == "json_object":
        constraint = _checked(StructuredOutput(json_object=True), param)
    else:
        constraint = _BUILDERS[kind](values[kind], param)
    if not given.disable_any_whitespace:
        return constraint
    return Constraint(replace(constraint.output, disable_any_whitespace=True), param)


def _json(schema: Any, param: str) -> Constraint:
    """A schema given as an object is sent as its JSON text; one given as text must parse."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise APIError(400, f"{param} is not valid JSON: {exc}", param=param) from None
        if not isinstance(parsed, dict):  # as the engine: a boolean schema is refused too
            message = f"{param} must be a JSON schema (an object), got {type(parsed).__name__}"
            raise APIError(400, message, param=param)
        text = schema
    else:
        text = json.dumps(schema)
    _check_length(text, param)
    return _checked(StructuredOutput(json=text), param)


def _regex(pattern: Any, param: str) -> Constraint:
    if not pattern:
        raise APIError(400, f"{param} must be a non-empty regular expression", param=param)
    _check_length(pattern, param)
    return _checked(StructuredOutput(regex=pattern), param)


def _grammar(grammar: Any, param: str) -> Constraint:
    if not grammar:
        raise APIError(400, f"{param} must be a non-empty grammar", param=param)
    _check_length(grammar, param)
    return _checked(StructuredOutput(grammar=grammar), param)


def _choice(choices: Any, param: str) -> Constraint:
    if not choices:
        raise APIError(400, f"{param} must hold at least one choice", param=param)
    if len(choices) > MAX_CHOICES:
        message = f"{param} holds {len(choices)} choices; at most {MAX_CHOICES} are allowed"
        raise APIError(400, message, param=param)
    empty = next((i for i, choice in enumerate(choices) if not choice), None)
    if empty is not None:
        raise APIError(400, f"{param}[{empty}] is empty: a choice is text", param=param)
    _check_length("".join(choices), param)
    return _checked(StructuredOutput(choice=tuple(choices)), param)


# The constraints given as one value, by kind. Values arrive type-checked by the schemas.
_BUILDERS: dict[str, Callable[[Any, str], Constraint]] = {
    "json": _json,
    "regex": _regex,
    "choice": _choice,
    "grammar": _grammar,
}


def _check_length(text: str, param: str) -> None:
    if len(text) > MAX_STRUCTURED_CHARS:
        raise APIError(
            400,
            f"{param} holds {len(text)} characters; at most {MAX_STRUCTURED_CHARS} are allowed",
            param=param,
        )


def _checked(output: StructuredOutput, param: str) -> Constraint:
    """The protocol's own check, for what the ones above do not foresee."""
    try:
        output.validate()
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None
    return Constraint(output, param)
