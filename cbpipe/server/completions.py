"""``POST /v1/completions``: OpenAI's legacy completions, streaming or not.

A prompt is a string, a list of token ids, or a list of either (one job each); a choice's
index is ``prompt_index * n + sample_index``, as OpenAI numbers them. ``echo`` puts the
prompt before the output, and with ``logprobs`` the prompt tokens' log-probabilities before
the output's (the first token has none).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from cbpipe.client import PromptLogprob, Result
from cbpipe.client.jobs import TopLogprobs
from cbpipe.server.common import (
    Envelope,
    EventStream,
    ServerState,
    cancelled_on_disconnect,
    first_batch_then,
    max_new_tokens,
    new_id,
    now_s,
    sampling_options,
    stream_events,
    top_alternatives,
)
from cbpipe.server.errors import APIError, from_engine
from cbpipe.server.generation import Batch, Generation
from cbpipe.server.schemas import CompletionRequest
from cbpipe.server.structured import requested_constraint
from cbpipe.server.text import Text, TextError

DEFAULT_MAX_TOKENS = 16  # OpenAI's
# Choices (prompts x n) one request may ask for: each is a job, and one request's thousands
# of jobs would hold the scheduler's admission for seconds, all other clients behind them.
MAX_CHOICES = 2048


async def create_completion(
    body: CompletionRequest, request: Request, state: ServerState
) -> Response:
    state.check_model(body.model)
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise APIError(400, "best_of must equal n: every sample drawn is returned", param="best_of")
    items = _prompt_items(body.prompt)
    choices = n * len(items)
    if choices > MAX_CHOICES:
        raise APIError(
            400,
            f"this request asks for {choices} choices (prompts x n), more than the "
            f"{MAX_CHOICES} one request may: split it",
            param="prompt",
        )
    # Off the event loop: a long prompt must not stall the other streams while it tokenizes.
    texts, prompts = await asyncio.to_thread(
        _prompts, items, state.text, bool(body.add_special_tokens)
    )
    logprobs = body.logprobs
    constraint = requested_constraint(body)
    names = {} if constraint is None else {"structured_outputs": constraint.param}
    options = sampling_options(
        body,
        detokenize=state.text.has_tokenizer,
        defaults=state.defaults,
        logprobs=logprobs,
        prompt_logprobs=logprobs if body.echo and logprobs is not None else None,
        structured_output=None if constraint is None else constraint.output,
    )
    scoring = body.max_tokens == 0
    if scoring and not body.echo:
        message = "max_tokens 0 makes nothing: it takes echo, to score the prompt"
        raise APIError(400, message, param="max_tokens")
    default = state.defaults.max_tokens or DEFAULT_MAX_TOKENS
    model_len = state.client.max_model_len
    limits = [
        # Scored, the engine still takes a prompt to continue: one token, which is dropped.
        1 if scoring else max_new_tokens(body.max_tokens, default, len(p), model_len, "max_tokens")
        for p in prompts
    ]
    try:
        generation = Generation(
            state.client, state.metrics, prompts, limits, options, keep_outputs=not scoring
        )
    except Exception as exc:
        raise from_engine(exc, names) from None
    format = _Format(state.text, body, prompts, texts, n, names)
    if body.stream:
        return await _stream(generation, format, request, state)
    return await _complete(generation, format, request, state)


def _prompt_items(prompt: object) -> list[Any]:
    """The request's prompts: one string or token-id list, or a list of them."""
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and isinstance(prompt[0], int)
    ):
        return [prompt]
    assert isinstance(prompt, list)
    return prompt


def _prompts(
    items: list[Any], text: Text, add_special_tokens: bool = False
) -> tuple[list[str | None], list[list[int]]]:
    """Each prompt's text (None for token ids) and token ids."""
    if not items:
        raise APIError(400, "prompt is empty", param="prompt")
    texts: list[str | None] = []
    token_ids: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            try:
                ids = text.encode(item, add_special_tokens)
            except TextError as exc:
                raise APIError(400, str(exc), param="prompt") from None
            texts.append(item)
        else:
            ids = list(item)
            texts.append(None)
        if not ids:
            raise APIError(400, "prompt is empty", param="prompt")
        token_ids.append(ids)
    return texts, token_ids


@dataclass
class _Format:
    """How this request's choices look: echo, log-probabilities, token ids."""

    text: Text
    body: CompletionRequest
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    n: int
    names: dict[str, str]  # the request's names of engine parameters (``from_engine``)
    offsets: dict[int, int] = field(default_factory=dict)  # choice -> text offset so far

    def prompt_text(self, prompt_index: int) -> str:
        given = self.prompt_texts[prompt_index]
        return given if given is not None else self.text.decode(self.prompts[prompt_index])

    def logprobs(
        self,
        choice: int,
        token_ids: Sequence[int],
        logprobs: Sequence[float | None],
        tops: Sequence[TopLogprobs | None],
    ) -> dict[str, Any]:
        """The legacy ``logprobs`` object of some tokens of a choice, continuing its text
        offsets. Each token's alternatives include the token itself, as vLLM's do."""
        strings = [self.text.token_string(t) for t in token_ids]
        offset = self.offsets.get(choice, 0)
        offsets = []
        # Offsets into the choice's text: without a tokenizer it is empty, and the strings
        # name the tokens (token_id:<id>) rather than spell them.
        spelled = self.text.has_tokenizer
        for s in strings:
            offsets.append(offset)
            offset += len(s) if spelled else 0
        self.offsets[choice] = offset
        top_dicts: list[dict[str, float] | None] = []
        for s, lp, top in zip(strings, logprobs, tops, strict=True):
            if top is None or lp is None:
                top_dicts.append(None)
            else:
                top_dicts.append({**dict(top_alternatives(self.text, top)), s: lp})
        return {
            "tokens": strings,
            "token_logprobs": list(logprobs),
            "top_logprobs": top_dicts,
            "text_offset": offsets,
        }

    def prompt_logprobs(self, choice: int, prompt_index: int, given: PromptLogprob | None) -> Any:
        prompt = self.prompts[prompt_index]
        if given is None:  # a one-token prompt has nothing to score
            return self.logprobs(choice, prompt, [None] * len(prompt), [None] * len(prompt))
        return self.logprobs(choice, given.token_ids, given.logprobs, given.top_logprobs)

    def result_choice(self, prompt_index: int, result: Result) -> dict[str, Any]:
        if result.finish_reason == "error":
            raise APIError(500, "the engine failed this request", code="engine_error")
        choice = prompt_index * self.n + result.index
        text = result.text or ""
        logprobs = None
        if self.body.logprobs is not None:
            assert result.logprobs is not None
            tops: list[TopLogprobs | None] = list(
                result.top_logprobs or [[]] * len(result.logprobs)
            )
            # The echoed prompt first: the text offsets run on from it.
            echoed = (
                self.prompt_logprobs(choice, prompt_index, result.prompt_logprobs)
                if self.body.echo
                else None
            )
            logprobs = self.logprobs(choice, result.token_ids, list(result.logprobs), tops)
            if echoed is not None:
                logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
        if self.body.echo:
            text = self.prompt_text(prompt_index) + text
        entry: dict[str, Any] = {
            "index": choice,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
        }
        if self.body.return_token_ids:
            entry["prompt_token_ids"] = self.prompts[prompt_index]
            entry["token_ids"] = result.token_ids
        return entry


async def _complete(
    generation: Generation, format: _Format, request: Request, state: ServerState
) -> Response:
    async with cancelled_on_disconnect(request, generation):
        try:
            async for _ in generation.batches():
                pass
            results = await generation.results()
        except Exception as exc:
            raise from_engine(exc, format.names) from None
    choices = [format.result_choice(p, r) for p, rs in enumerate(results) for r in rs]
    return JSONResponse(
        {
            "id": new_id("cmpl"),
            "object": "text_completion",
            "created": now_s(),
            "model": state.model_name,
            "choices": choices,
            "usage": generation.usage(),
        }
    )


async def _stream(
    generation: Generation, format: _Format, request: Request, state: ServerState
) -> Response:
    first, batches = await first_batch_then(generation, request, format.names)
    envelope = Envelope(
        {
            "id": new_id("cmpl"),
            "object": "text_completion",
            "created": now_s(),
            "model": state.model_name,
        }  # fmt: skip
    )
    return EventStream(_events(generation, format, envelope, first, batches), generation)


def _events(
    generation: Generation,
    format: _Format,
    envelope: Envelope,
    first: Batch | None,
    batches: AsyncIterator[Batch],
) -> AsyncIterator[bytes]:
    echoed: set[int] = set()

    def choices_of(batch: Batch) -> Iterator[list[dict[str, Any]]]:
        if format.body.echo and batch.prompt_index not in echoed:
            echoed.add(batch.prompt_index)
            yield _echo_choices(generation, format, batch.prompt_index)
        for choice in _batch_choices(format, batch):
            yield [choice]

    options = format.body.stream_options
    return stream_events(generation, options, envelope, first, batches, choices_of)


def _echo_choices(generation: Generation, format: _Format, prompt_index: int) -> list[Any]:
    choices = []
    for sample in range(format.n):
        choice = prompt_index * format.n + sample
        entry: dict[str, Any] = {
            "index": choice,
            "text": format.prompt_text(prompt_index),
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }
        if format.body.logprobs is not None:
            given = generation.jobs[prompt_index].prompt_logprobs
            entry["logprobs"] = format.prompt_logprobs(choice, prompt_index, given)
        choices.append(entry)
    return choices


def _batch_choices(format: _Format, batch: Batch) -> list[dict[str, Any]]:
    """One chunk's choice per sample that moved: its deltas in this batch joined."""
    choices = []
    for index, entry in batch.by_sample().items():
        choice = batch.prompt_index * format.n + index
        out: dict[str, Any] = {
            "index": choice,
            "text": entry.text,
            "logprobs": None,
            "finish_reason": entry.finish_reason,
            "stop_reason": entry.stop_reason,  # vLLM's, in every chunk
        }
        if format.body.logprobs is not None and entry.token_ids:
            out["logprobs"] = format.logprobs(
                choice, entry.token_ids, entry.logprobs, entry.top_logprobs
            )
        if format.body.return_token_ids:
            out["token_ids"] = entry.token_ids
        choices.append(out)
    return choices
