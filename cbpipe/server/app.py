"""The ASGI application: routes, authentication and the OpenAI-shaped error replies."""

from __future__ import annotations

import contextlib
import importlib.metadata
import secrets
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cbpipe.client import EngineError
from cbpipe.server.chat import create_chat_completion
from cbpipe.server.common import ServerState
from cbpipe.server.completions import create_completion
from cbpipe.server.errors import APIError
from cbpipe.server.metrics import CONTENT_TYPE
from cbpipe.server.schemas import (
    NULL_ONLY,
    UNION_TYPES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from cbpipe.server.tokenize import detokenize, tokenize

HEALTH_TIMEOUT_S = 5.0  # an engine that cannot answer its counters in this long is not well


# A body larger than this is refused (413) before it is read whole: the longest prompt the
# engine takes, as JSON token ids, is far smaller.
MAX_BODY_BYTES = 64 * 1024 * 1024


def build_app(state: ServerState, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="cbpipe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.cbpipe = state
    _add_error_handlers(app, state)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    async def authorized(request: Request) -> None:  # async: no thread-pool hop a request
        if state.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            key.strip().encode(), state.api_key.encode()
        ):
            raise APIError(
                401, "missing or incorrect API key (Authorization: Bearer <key>)",
                code="invalid_api_key",
            )  # fmt: skip

    v1 = [Depends(authorized)]

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, state)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, state)

    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "cbpipe",
                    "max_model_len": state.client.max_model_len,
                }
            ],
        }

    @app.post("/tokenize", dependencies=v1)
    async def tokenize_prompt(body: TokenizeRequest) -> dict[str, Any]:
        return await tokenize(body, state)

    @app.post("/detokenize", dependencies=v1)
    async def detokenize_ids(body: DetokenizeRequest) -> dict[str, Any]:
        return await detokenize(body, state)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("cbpipe")}

    @app.get("/health")
    async def health() -> Response:
        try:
            await state.client.stats(timeout=HEALTH_TIMEOUT_S)
        except EngineError as exc:
            message = f"the engine is unavailable: {exc}"
            raise APIError(503, message, code="engine_unavailable") from None
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        # Without an engine the gauges keep their last values; /health says what is wrong.
        with contextlib.suppress(EngineError):
            state.metrics.set_engine_stats(await state.client.stats(timeout=HEALTH_TIMEOUT_S))
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    return app


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        state.metrics.request_failed(exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc.errors())
        state.metrics.request_failed(error.status)
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        state.metrics.request_failed(exc.status_code)
        return APIError(exc.status_code, str(exc.detail)).response()


class BodyLimit:
    """Refuse a request body over ``max_bytes`` with a 413, by its Content-Length or, for a
    chunked one, once that many bytes arrived."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = APIError(413, f"the request body exceeds {self.max_bytes} bytes")
        headers = dict(scope.get("headers", ()))
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            await too_big.response()(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise too_big
            return message

        await self.app(scope, counted, send)


def _validation_error(errors: Any) -> APIError:
    """A 400 for pydantic's first complaint, naming the field as the request spells it."""
    if not errors:
        return APIError(400, "invalid request")
    # A union reports each member's complaint: a lone surrogate in one of them (text parts,
    # say) says more than the others' type errors.
    error = next((e for e in errors if e.get("type") == "lone_surrogate"), errors[0])
    kind, message = error.get("type", ""), error.get("msg", "invalid value")
    loc = [part for part in error.get("loc", ()) if part != "body"]
    if kind == "json_invalid":
        return APIError(
            400, f"the body is not valid JSON: {error.get('ctx', {}).get('error', message)}"
        )
    if not loc:
        return APIError(400, f"the body must be a JSON object of the request's fields: {message}")
    param = _param_name(loc)
    if kind == "extra_forbidden":
        return APIError(400, f"{param} is not supported by cbpipe", param=param)
    last = param.rsplit(".", 1)[-1].split("[", 1)[0]
    if last in NULL_ONLY and kind == "none_required":
        return APIError(400, f"{param}: {NULL_ONLY[last]}", param=param)
    if kind == "missing":
        return APIError(400, f"{param} is required", param=param)
    if last in UNION_TYPES and kind.endswith("_type"):
        return APIError(400, f"{param} must be {UNION_TYPES[last]}", param=param)
    return APIError(400, f"{param}: {message}", param=param)


def _param_name(loc: list[Any]) -> str:
    """``messages[0].content`` from pydantic's location, leaving out the names of union
    members that it puts in (``str``, ``list[int]``, ...)."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            name += f".{part}" if name else part
        else:
            break
    return name


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}
