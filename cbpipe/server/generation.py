"""One HTTP request's jobs on the engine: one per prompt, each of ``n`` samples.

``Generation`` submits them, merges their deltas into one stream of batches, times every
sample for the metrics, and cancels what is left when the request ends early (the client
disconnected, or one prompt failed and with it the whole request).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from cbpipe.client import AsyncClient, AsyncJob, Delta, Result, SamplingOptions
from cbpipe.client.jobs import TopLogprobs
from cbpipe.server.metrics import ServerMetrics


@dataclass
class _SampleClock:
    first_s: float | None = None
    last_s: float = 0.0
    num_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class SampleDelta:
    """One sample's deltas of a batch, joined: what one streamed chunk of it carries."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class Batch:
    """What arrived at once for one prompt: deltas of its samples, in arrival order."""

    prompt_index: int
    deltas: list[Delta]

    def by_sample(self) -> dict[int, SampleDelta]:
        """The deltas of each sample that moved, joined, in the order they first moved."""
        joined: dict[int, SampleDelta] = {}
        for delta in self.deltas:
            entry = joined.get(delta.index)
            if entry is None:
                entry = joined[delta.index] = SampleDelta()
            entry.token_ids += delta.token_ids
            entry.text += delta.text
            if delta.logprobs is not None:
                entry.logprobs += delta.logprobs
                entry.top_logprobs += delta.top_logprobs or [[] for _ in delta.logprobs]
            if delta.finish_reason is not None:
                entry.finish_reason, entry.stop_reason = delta.finish_reason, delta.stop_reason
        return joined


@dataclass
class Generation:
    client: AsyncClient
    metrics: ServerMetrics
    prompts: Sequence[list[int]]
    max_new_tokens: Sequence[int]
    options: SamplingOptions
    # False: the prompts are scored, not continued (a completion's echo with max_tokens 0).
    # The engine samples a token a job all the same; it is dropped here, as if never made.
    keep_outputs: bool = True
    arrival_s: float = field(default_factory=time.perf_counter)
    jobs: list[AsyncJob] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        """Submit every prompt; a ``RequestError`` from the client cancels those already
        submitted before it propagates."""
        try:
            for prompt, limit in zip(self.prompts, self.max_new_tokens, strict=True):
                self.jobs.append(self.client.submit(prompt, max_new_tokens=limit, **self.options))
        except Exception:
            self.cancel_unfinished()
            raise
        self.n = self.jobs[0].params.n
        self._clocks = [[_SampleClock() for _ in range(self.n)] for _ in self.jobs]
        self.num_prompt_tokens = sum(len(p) for p in self.prompts)
        self.num_generated_tokens = 0
        self.num_cached_tokens: int | None = None  # known once the results are in
        self._recorded = False  # in the metrics: by ``results()``, or as the client left

    async def batches(self) -> AsyncIterator[Batch]:
        """Every job's deltas as they arrive, timed; raises the first job error (and
        cancels the other jobs)."""
        source = self._one() if len(self.jobs) == 1 else self._merged()
        try:
            async for batch in source:
                if not self.keep_outputs:
                    batch = Batch(batch.prompt_index, [_dropped(d) for d in batch.deltas])
                self._observe(batch)
                yield batch
        except BaseException:
            self.cancel_unfinished()
            raise

    async def results(self) -> list[list[Result]]:
        """Each prompt's results, by sample, once ``batches()`` is exhausted; recorded in the
        metrics."""
        results = [await job.results() for job in self.jobs]
        if not self.keep_outputs:
            results = [[_dropped_result(r) for r in rs] for rs in results]
        # Each prompt counts once, whatever n: the tokens its least served sample computed
        # were computed for it (the others may have found the first's blocks).
        self.num_cached_tokens = sum(
            min(r.num_cached_tokens for r in prompt_results) for prompt_results in results
        )
        if self._recorded:
            return results
        self._recorded = True
        now = time.perf_counter()
        self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        self.metrics.generation_tokens.inc(self.num_generated_tokens)
        for prompt_results, clocks in zip(results, self._clocks, strict=True):
            for result, clock in zip(prompt_results, clocks, strict=True):
                self.metrics.request_finished(result.finish_reason)
                self.metrics.e2e_request_latency.observe(now - self.arrival_s)
                self.metrics.request_queue_time.observe(result.queue_time_s)
                if clock.first_s is not None and clock.num_tokens > 1:
                    per_token = (clock.last_s - clock.first_s) / (clock.num_tokens - 1)
                    self.metrics.time_per_output_token.observe(per_token)
        return results

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object: prompt tokens (each prompt once, whatever ``n``), generated
        tokens, and once the results are in, the prompt tokens the prefix cache served."""
        body: dict[str, Any] = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_generated_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_generated_tokens,
        }
        if self.num_cached_tokens is not None:
            body["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        return body

    def client_left(self) -> None:
        """Cancel what is unfinished, and count the request in the metrics as it stands:
        the tokens it got, and each sample the client did not see finish as cancelled."""
        self.cancel_unfinished()
        if self._recorded:
            return
        self._recorded = True
        self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        self.metrics.generation_tokens.inc(self.num_generated_tokens)
        for clocks in self._clocks:
            for clock in clocks:
                self.metrics.request_finished(clock.finish_reason or "cancelled")

    def cancel_unfinished(self) -> None:
        """Ask the engine to stop every job not yet finished (without awaiting: this runs in
        a cancelled task's clean-up too)."""
        for job in self.jobs:
            job.cancel_nowait()

    # --- internals --------------------------------------------------------------------

    async def _one(self) -> AsyncIterator[Batch]:
        async for deltas in self.jobs[0].delta_batches():
            yield Batch(0, deltas)

    async def _merged(self) -> AsyncIterator[Batch]:
        queue: asyncio.Queue[Batch | BaseException | None] = asyncio.Queue()

        async def pump(index: int, job: AsyncJob) -> None:
            try:
                async for deltas in job.delta_batches():
                    queue.put_nowait(Batch(index, deltas))
            except Exception as exc:
                queue.put_nowait(exc)
            else:
                queue.put_nowait(None)

        tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(self.jobs)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    def _observe(self, batch: Batch) -> None:
        now = time.perf_counter()
        clocks = self._clocks[batch.prompt_index]
        for delta in batch.deltas:
            clock = clocks[delta.index]
            clock.finish_reason = delta.finish_reason or clock.finish_reason
            if not delta.token_ids:
                continue
            if clock.first_s is None:
                clock.first_s = now
                self.metrics.time_to_first_token.observe(now - self.arrival_s)
            else:
                self.metrics.inter_token_latency.observe(now - clock.last_s)
            clock.last_s = now
            clock.num_tokens += len(delta.token_ids)
            self.num_generated_tokens += len(delta.token_ids)


def _dropped(delta: Delta) -> Delta:
    """A delta of a scored prompt: its token gone, its end the length limit (of none)."""
    finish = None if delta.finish_reason is None else _SCORED_FINISH
    return Delta(delta.index, [], "", [] if delta.logprobs is not None else None, None, finish)


def _dropped_result(result: Result) -> Result:
    if result.finish_reason not in ("stop", "length"):
        return result  # cancelled or failed: said as it is
    return dataclasses.replace(
        result,
        token_ids=[],
        text="" if result.text is not None else None,
        logprobs=[] if result.logprobs is not None else None,
        top_logprobs=[] if result.top_logprobs is not None else None,
        finish_reason=_SCORED_FINISH,
        stop_reason=None,
    )


_SCORED_FINISH = "length"  # zero tokens asked, zero made: the limit is what ended it
