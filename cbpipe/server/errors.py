"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the status
that says what went wrong (400 bad request, 401 no or wrong key, 404 unknown model or path,
503 the engine is gone)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from cbpipe.client.jobs import EngineBusy, EngineError, RequestError

# The engine's parameter names, as the HTTP API spells them.
ENGINE_TO_HTTP_NAMES = {
    "max_new_tokens": "max_tokens",
    "prompt_logprobs": "logprobs",
    "prompt token id": "prompt",
    "prompt": "prompt",
    "stop token id": "stop_token_ids",
    "each stop string": "stop",
}
ENGINE_NAMES = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "stop",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "n",
    "cache_salt",
)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error reply; raised anywhere in a request's handling."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def event(self) -> bytes:
        """The error as a server-sent event, for a stream whose status line went out."""
        return f"data: {json.dumps(self.body())}\n\n".encode()


def from_engine(error: Exception, names: Mapping[str, str] | None = None) -> APIError:
    """The reply for what a job raised: the engine refused it (400) or is gone (503).
    ``names``: the request's own spelling of a parameter that has several
    (``max_completion_tokens`` for ``max_tokens``, the field that asked for the
    ``structured_outputs``)."""
    if isinstance(error, RequestError):
        message = str(error)
        param = _param_of(message)
        if param is not None and names:
            param = names.get(param, param)
        return APIError(400, message, param=param)
    if isinstance(error, EngineBusy):
        return APIError(503, f"the engine is busy, retry later: {error}", code="engine_busy")
    if isinstance(error, EngineError):
        return APIError(503, f"the engine is unavailable: {error}", code="engine_unavailable")
    raise error


def _param_of(message: str) -> str | None:
    # The engine's refusals of a constraint say "invalid structured_output.regex: ..." and
    # the like, or that it has no structured output at all.
    if "structured_output" in message or "structured output" in message:
        return "structured_outputs"
    for engine_name, http_name in ENGINE_TO_HTTP_NAMES.items():
        if message.startswith(engine_name + " "):
            return http_name
    for name in ENGINE_NAMES:
        if message.startswith((name + " ", name + "[")):
            return name
    return None
