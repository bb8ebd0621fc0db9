"""Request bodies of the OpenAI-compatible API, as pydantic models.

Field names and meanings are OpenAI's; cbpipe's extensions take vLLM's names. Every model
forbids fields it does not declare, so a field cbpipe does not implement is a 400 that names
it, never a silent ignore; the few declared only to be ignored are in ``IGNORED_FIELDS``.
Types are strict: ``"5"`` is not an integer and ``1`` is not a boolean.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from cbpipe.protocol.sampling import MAX_TOP_LOGPROBS

# Fields that change nothing about the output (OpenAI uses them for accounting, storage or
# its own caches): accepted and ignored. The README lists them.
IGNORED_FIELDS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
)

# What a field of a union type must be, for the 400 that a value of another type gets
# (pydantic's own message names only one of the options).
UNION_TYPES = {
    "prompt": "a string, a list of token ids, or a list of strings or of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "json": "a JSON schema: an object, or its JSON text",
    "guided_json": "a JSON schema: an object, or its JSON text",
}


# Fields that may only be null, and why: a value is a 400 that says so.
NULL_ONLY = {
    "suffix": "suffix (insertion) is not supported by cbpipe",
    "audio": "cbpipe makes no audio, so no earlier reply of its can carry any",
    "function_call": "the deprecated function_call is not supported: use tool_calls",
}

# JSON's \uXXXX escapes can spell half of a UTF-16 pair alone: a Python string holds it, but
# it is no text, and a tokenizer or an encoder meets it only to fail.
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        _refuse_surrogates(value)
        return value


def _refuse_surrogates(value: Any) -> None:
    """Raise for a lone surrogate anywhere in ``value``'s strings and keys (nested models
    check their own fields)."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        if found:
            raise PydanticCustomError(
                "lone_surrogate",
                "holds an unpaired UTF-16 surrogate ({code}), which is not text",
                {"code": f"\\u{ord(found.group()):04x}"},
            )
    elif isinstance(value, list):
        if value and isinstance(value[0], int):
            return  # token ids: the list's type is checked whole already
        for item in value:
            _refuse_surrogates(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_surrogates(key)
            _refuse_surrogates(item)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``; ``strict`` changes nothing: the output
    always follows the schema (it is the grammar the engine samples in)."""

    name: str
    description: str | None = None
    # "schema" would shadow BaseModel.schema: the field is named apart, the JSON key is kept.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # with type "json_schema" only


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: one constraint of ``StructuredOutput``'s, and how JSON
    may be spaced."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a schema, or its text
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # a Lark grammar, in llguidance's dialect
    disable_any_whitespace: bool | None = None


class _SamplingFields(_Strict):
    """What completions and chat requests share: OpenAI's sampling fields, then vLLM's."""

    model: str | None = None
    n: int | None = Field(1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int | None = None  # 0 or -1: every token
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    return_token_ids: bool | None = None  # token ids beside the text (and without a tokenizer)
    cache_salt: str | None = None  # shares cached prompt blocks only with the same salt
    # Structured output (``structured.py``): OpenAI's field, vLLM's, and vLLM's older names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted and ignored: IGNORED_FIELDS.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    # default: the model's recommendation, or 16; 0 with echo scores the prompt (vLLM's)
    max_tokens: int | None = Field(None, ge=0)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None  # only None or n: cbpipe returns every sample it draws
    add_special_tokens: bool | None = False  # vLLM's; a text prompt's BOS, say (default: none)
    suffix: None = None  # insertion is not supported: any value is a 400


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object


class MessageToolCall(_Strict):
    """A call an assistant message made, as an earlier reply gave it."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's answer: the call it answers
    # An earlier reply sent back as the openai package gives it (``message.model_dump()``
    # has every field of OpenAI's assistant message, null or not).
    reasoning_content: str | None = None  # vLLM's: shown to the chat template
    refusal: str | None = None  # ignored: the model's text is in content
    annotations: list[Any] | None = None  # ignored: OpenAI's citations of a web search
    audio: None = None  # NULL_ONLY
    function_call: None = None  # NULL_ONLY


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    # "required" and a named function force calls through structured output (``tool_choice.py``)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extensions for the chat template
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's): a ``prompt`` as ``/v1/completions`` tokenizes it, or
    ``messages`` as ``/v1/chat/completions`` renders and tokenizes them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None  # rendered by the chat template, as in a chat request
    add_special_tokens: bool | None = None  # default: as the endpoint it stands for (none)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    return_token_strs: bool | None = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's)."""

    model: str | None = None
    tokens: TokenIds
