"""The HTTP app in-process with a scripted engine: every job answers with given text pieces
(one delta each), or is refused with a given message, and the engine keeps the parameters
each job was submitted with. For tests of what the server makes of a request and of a
reply, without starting an engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from cbpipe.client import Delta, RequestError, Result
from cbpipe.client.jobs import make_params
from cbpipe.protocol.sampling import SamplingParams


@dataclass
class ScriptedJob:
    """A job whose every sample writes ``pieces``, one delta each, then ends with
    ``finish_reason``; or, with ``refusal``, the engine's refusal of it."""

    params: SamplingParams
    pieces: list[str]
    finish_reason: str = "stop"
    refusal: str | None = None
    prompt_logprobs: None = None

    async def delta_batches(self) -> AsyncIterator[list[Delta]]:
        if self.refusal is not None:
            raise RequestError(self.refusal)
        for sample in range(self.params.n):
            for i, piece in enumerate(self.pieces):
                yield [Delta(sample, [100 + i], piece)]
            yield [Delta(sample, [], "", finish_reason=self.finish_reason)]

    async def results(self) -> list[Result]:
        if self.refusal is not None:
            raise RequestError(self.refusal)
        text = "".join(self.pieces)
        token_ids = list(range(100, 100 + len(self.pieces)))
        return [
            Result(token_ids, text, self.finish_reason, 5, index=i) for i in range(self.params.n)
        ]

    def cancel_nowait(self) -> None:
        pass


@dataclass
class ScriptedEngine:
    """What ``Generation`` and the routes use of ``AsyncClient``; ``params`` are the jobs'
    parameters as the real client makes them (``make_params``: validated)."""

    pieces: list[str]
    finish_reason: str = "stop"
    refusal: str | None = None
    prompts: list[list[int]] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    max_model_len: int = 2048
    vocab_size: int = 2048

    def submit(self, prompt: list[int], *, max_new_tokens: int, **options: Any) -> ScriptedJob:
        params = make_params(max_new_tokens, options)  # type: ignore[arg-type]
        self.prompts.append(list(prompt))
        self.params.append(params)
        return ScriptedJob(params, self.pieces, self.finish_reason, self.refusal)
