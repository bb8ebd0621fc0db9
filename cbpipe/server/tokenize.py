"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: what the generation endpoints would
make of a prompt, without generating.

``/tokenize`` counts exactly what ``/v1/completions`` (a ``prompt``) or
``/v1/chat/completions`` (``messages``) would send to the engine, and says how long a
sequence the engine holds, so that a client can fit its prompt and ``max_tokens`` before it
asks.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cbpipe.server.chat import render_conversation
from cbpipe.server.common import ServerState
from cbpipe.server.errors import APIError
from cbpipe.server.schemas import DetokenizeRequest, TokenizeRequest
from cbpipe.server.text import TextError


async def tokenize(body: TokenizeRequest, state: ServerState) -> dict[str, Any]:
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    try:
        # Off the event loop, as the generation endpoints tokenize.
        if body.messages is not None:
            param = "messages"
            if body.add_special_tokens:
                raise TextError("add_special_tokens: the chat template writes the special tokens")
            token_ids = await render_conversation(state.text, body)
        else:
            assert body.prompt is not None
            param = "prompt"
            token_ids = await asyncio.to_thread(
                state.text.encode, body.prompt, bool(body.add_special_tokens)
            )
    except TextError as exc:
        raise APIError(400, str(exc), param=param) from None
    reply: dict[str, Any] = {
        "count": len(token_ids),
        "max_model_len": state.client.max_model_len,
        "tokens": token_ids,
    }
    if body.return_token_strs:
        reply["token_strs"] = state.text.vocabulary_names(token_ids)
    return reply


async def detokenize(body: DetokenizeRequest, state: ServerState) -> dict[str, Any]:
    state.check_model(body.model)
    if not state.text.has_tokenizer:
        raise APIError(400, f"model {state.model_name} has no tokenizer", param="tokens")
    vocab = state.client.vocab_size
    if outside := [t for t in body.tokens if t >= vocab]:
        raise APIError(
            400, f"token id {outside[0]} is outside the vocabulary [0, {vocab})", param="tokens"
        )
    # Special tokens skipped, as in the engine's outputs.
    return {"prompt": await asyncio.to_thread(state.text.decode, body.tokens)}
