"""The client-facing half of the scheduler: validating jobs, mapping ids, replying.

Clients talk to a ROUTER socket; every frame arrives with the client's identity. A job is
known to the client by its own ``request_id``; each of its ``n`` samples is a request of its
own to the scheduler core, under an engine-wide id. Every way a frame can be wrong ends here
as an ``Error`` reply (or a dropped frame when no client can be named); nothing that a client
sends can reach the core unvalidated.

Outbound, a step's results pass the text stage (``detokenizer.py``) on their way to the
clients: each sample's tokens become text (but for the EOS or stop token that ends it, as in
vLLM), and a stop string found there finishes the sample through ``Scheduler.finish`` like any
other stop. A client that makes its jobs' text itself asks for ids only; the ``ends`` column
of ``Tokens`` and a sample's own ``Cancel`` are what it needs to do it as this stage would.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import zmq

from cbpipe.detokenizer import Detokenizer, SampleText
from cbpipe.protocol.messages import (
    MAX_FRAME_BYTES,
    Cancel,
    Error,
    ErrorKind,
    Finished,
    FinishReasonName,
    GetStats,
    Goodbye,
    Hello,
    Message,
    PromptLogprobs,
    ProtocolError,
    Stats,
    Submit,
    TokenEnd,
    Tokens,
    Welcome,
    decode,
    encode,
    request_id_of,
)
from cbpipe.protocol.sampling import MAX_SEED, SamplingParams, safe_repr
from cbpipe.protocol.slots import MAX_EOS_TOKEN_IDS
from cbpipe.scheduler.core import RequestUpdate, Scheduler
from cbpipe.scheduler.preparation import Preparation, Prepared, PromptTooLong
from cbpipe.scheduler.request import FINISH_REASONS, Request, RequestStatus
from cbpipe.scheduler.structured import Grammars, TokenGrammar

log = logging.getLogger("cbpipe.scheduler")

_MASK64 = (1 << 63) - 1


class RequestRejected(ValueError):
    """A job that cannot be served; the message is sent to the client as is."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    max_total_tokens: int  # prompt + outputs, bounded by the model and the KV cache
    eos_token_ids: frozenset[int]

    def __post_init__(self) -> None:
        if len(self.eos_token_ids) > MAX_EOS_TOKEN_IDS:
            raise ValueError(
                f"the model declares {len(self.eos_token_ids)} EOS token ids; the slots hold "
                f"bans for {MAX_EOS_TOKEN_IDS}"
            )


@dataclass(frozen=True)
class Origin:
    identity: bytes
    client_request_id: int


@dataclass
class Job:
    """A client's job as the frontend tracks it: its samples' engine ids, the ones still
    open, and each sample's text while it is produced."""

    origin: Origin
    engine_ids: list[int]
    open: set[int]
    texts: dict[int, SampleText] = field(default_factory=dict)  # by engine id
    prompt_logprobs_sent: bool = False


class Frontend:
    def __init__(
        self,
        socket: zmq.Socket,
        scheduler: Scheduler,
        model: ModelInfo,
        tokenizer: Any | None,
        *,
        max_waiting_requests: int = 65536,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        grammars: Grammars | str | None = None,
    ) -> None:
        """``grammars``: structured output's compiler, or why this engine has none."""
        self.socket = socket
        self.max_frame_bytes = max_frame_bytes
        self.scheduler = scheduler
        self.model = model
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.preparation = (
            Preparation(tokenizer, model.max_total_tokens) if tokenizer is not None else None
        )
        self.max_waiting_requests = max_waiting_requests
        self.grammars = grammars
        self.failure: str | None = None  # set once the engine cannot serve any more
        self._jobs: dict[Origin, Job] = {}
        # Jobs on the preparation thread: text prompts, structured-output constraints.
        self._preparing: dict[Origin, Submit] = {}
        self._gone: set[bytes] = set()  # clients whose connections are gone
        self._job_of: dict[int, Job] = {}  # by engine id
        self._next_id = 0
        self._handlers: dict[type[Message], Callable[[bytes, Message], None]] = {
            Hello: self._on_hello,
            Submit: self._on_submit,
            Cancel: self._on_cancel,
            Goodbye: self._on_goodbye,
            GetStats: self._on_get_stats,
        }
        # Counters since start, for ``Stats``.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0

    # --- inbound ------------------------------------------------------------------------

    def receive(self) -> None:
        """Handle one multipart frame waiting on the socket.

        Each frame is handled inside its own error boundary: whatever goes wrong with one
        client's message ends that message with an error reply, never the engine."""
        parts = self.socket.recv_multipart(copy=True)
        if len(parts) != 2:
            log.debug("dropped a message of %d parts", len(parts))
            return
        identity, frame = parts
        try:
            message = decode(frame, expected=tuple(self._handlers))
        except ProtocolError as exc:
            self._send(identity, Error(request_id_of(frame), ErrorKind.REQUEST, str(exc)))
            return
        try:
            self._handlers[type(message)](identity, message)
        except Exception as exc:
            log.exception("failed to handle a %s from client %s", message.TYPE, identity.hex())
            request_id = getattr(message, "request_id", None)
            self._send(
                identity,
                Error(
                    request_id if isinstance(request_id, int) else None,
                    ErrorKind.REQUEST,
                    f"the engine failed to handle this {message.TYPE}: "
                    f"{type(exc).__name__}: {safe_repr(str(exc))}",
                ),
            )

    def _on_hello(self, identity: bytes, message: Message) -> None:
        self._send(
            identity,
            Welcome(
                self.model.name,
                self.model.vocab_size,
                self.model.max_total_tokens,
                self.tokenizer is not None,
                self.max_frame_bytes,
            ),
        )

    def _on_submit(self, identity: bytes, message: Message) -> None:
        assert isinstance(message, Submit)
        origin = Origin(identity, message.request_id)
        if self.failure is not None:
            self._send(identity, Error(message.request_id, ErrorKind.ENGINE, self.failure))
            return
        try:
            if origin in self._jobs or origin in self._preparing:
                raise RequestRejected(f"request_id {message.request_id} is already in use")
            self._check_params(message.params)
            queued = self.scheduler.num_waiting + len(self._preparing)
            if queued >= self.max_waiting_requests:
                self._send(
                    identity,
                    Error(
                        message.request_id,
                        ErrorKind.BUSY,
                        f"the engine is busy: {queued} requests are waiting; try again later",
                    ),
                )
                return
            prompt = message.prompt
            if isinstance(prompt, str) and self.preparation is None:
                raise RequestRejected(
                    f"model {self.model.name} has no tokenizer: send the prompt as token ids"
                )
            if not isinstance(prompt, str):
                prompt = self._checked_ids(prompt)
            spec = message.params.structured_output
            if isinstance(prompt, str) or spec is not None:
                assert self.preparation is not None  # a constraint needs the tokenizer
                self._preparing[origin] = message
                then = None if spec is None else functools.partial(self._grammars, message.params)
                self.preparation.submit(origin, prompt, then)
                return
            self._admit(origin, message, prompt, [None] * message.params.n)
        except RequestRejected as exc:
            self._send(identity, Error(message.request_id, ErrorKind.REQUEST, str(exc)))

    def on_jobs_prepared(self) -> None:
        """Admit the jobs that the preparation thread finished."""
        assert self.preparation is not None
        for key, result in self.preparation.finished():
            assert isinstance(key, Origin)
            message = self._preparing.pop(key, None)
            if message is None:
                continue  # cancelled while it was prepared
            try:
                if isinstance(result, RequestRejected):
                    raise result
                if isinstance(result, PromptTooLong):
                    raise RequestRejected(self._too_long(result.args[0]))
                if isinstance(result, Exception):
                    raise RequestRejected(f"the prompt could not be tokenized: {result}")
                assert isinstance(result, Prepared)
                grammars = result.extra or [None] * message.params.n
                self._admit(key, message, result.prompt, grammars)
            except RequestRejected as exc:
                self._send(key.identity, Error(message.request_id, ErrorKind.REQUEST, str(exc)))

    def _admit(
        self,
        origin: Origin,
        message: Submit,
        prompt: list[int],
        grammars: list[TokenGrammar | None],
    ) -> None:
        reqs = self._make_requests(message, prompt, grammars)
        job = Job(origin, [r.request_id for r in reqs], {r.request_id for r in reqs})
        self._jobs[origin] = job
        arrival_ns = time.perf_counter_ns()
        for req in reqs:
            self._job_of[req.request_id] = job
            if self.detokenizer is not None and req.params.detokenize:
                params = req.params
                job.texts[req.request_id] = self.detokenizer.sample(
                    params.stop,
                    params.min_tokens,
                    skip_special_tokens=params.skip_special_tokens,
                    include_stop=params.include_stop_str_in_output,
                )
            req.arrival_ns = arrival_ns
            self.num_prompt_tokens += req.num_prompt_tokens
            self.scheduler.add_request(req)

    def _on_cancel(self, identity: bytes, message: Message) -> None:
        assert isinstance(message, Cancel)
        origin = Origin(identity, message.request_id)
        index = message.index
        pending = self._preparing.get(origin)
        if pending is not None:  # not a request yet: its samples end here
            if index is not None:
                # A sample is stopped for what it produced; this job produced nothing yet.
                log.debug("ignored a cancel of sample %d of a job not started yet", index)
                return
            del self._preparing[origin]
            for sample in range(pending.params.n):
                self._send(identity, Finished(message.request_id, "cancelled", None, 0, sample))
            return
        job = self._jobs.get(origin)
        if job is None:
            return  # already finished: the client has or will get its Finished
        if index is None:
            self._cancel(job, job.open)
        elif 0 <= index < len(job.engine_ids):
            self._cancel(job, {job.engine_ids[index]} & job.open)
        else:
            self._send(
                identity,
                Error(
                    message.request_id,
                    ErrorKind.REQUEST,
                    f"cancel: job {message.request_id} has no sample {index}; it has "
                    f"{len(job.engine_ids)}",
                ),
            )

    def _on_get_stats(self, identity: bytes, message: Message) -> None:
        scheduler = self.scheduler
        blocks = scheduler.blocks
        self._send(
            identity,
            Stats(
                num_running=len(scheduler.running),
                num_waiting=scheduler.num_waiting + len(self._preparing),
                kv_cache_usage=1.0 - blocks.num_free_blocks / blocks.num_blocks,
                num_prompt_tokens=self.num_prompt_tokens,
                num_generation_tokens=self.num_generation_tokens,
                num_preemptions=scheduler.num_preemptions,
                num_steps=self.num_steps,
                num_prefix_query_tokens=blocks.num_query_tokens,
                num_prefix_hit_tokens=blocks.num_hit_tokens,
            ),
        )

    def _on_goodbye(self, identity: bytes, message: Message) -> None:
        """The client is closing and nobody will read these jobs' tokens: stop them now."""
        self._drop_client(identity, "closed")

    def _drop_client(self, identity: bytes, why: str) -> None:
        for origin in [o for o in self._preparing if o.identity == identity]:
            del self._preparing[origin]
        orphans = [job for origin, job in self._jobs.items() if origin.identity == identity]
        for job in orphans:
            self._cancel(job, job.open)
        if orphans:
            log.info("client %s %s: cancelled %d jobs", identity.hex(), why, len(orphans))

    def _cancel(self, job: Job, engine_ids: set[int]) -> None:
        for engine_id in list(engine_ids):
            req = self.scheduler.cancel(engine_id)
            if req is not None:
                self._finish(req)

    def _check_params(self, params: SamplingParams) -> None:
        try:
            params.validate()
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        self._check_token_ids(params)
        if params.detokenize and self.tokenizer is None and params.stop:
            raise RequestRejected(
                f"model {self.model.name} has no tokenizer: stop strings cannot be matched"
            )
        if params.structured_output is not None and not isinstance(self.grammars, Grammars):
            raise RequestRejected(self.grammars or "this engine has no structured output")

    def _too_long(self, num_tokens: int) -> str:
        return (
            f"prompt of {num_tokens} tokens is too long: this engine holds at most "
            f"{self.model.max_total_tokens} tokens per sequence, prompt and output together"
        )

    def _make_requests(
        self, message: Submit, prompt: list[int], grammars: list[TokenGrammar | None]
    ) -> list[Request]:
        """The job's samples as requests, for a checked prompt, each with its own place in
        the job's grammar (or None)."""
        params = message.params
        if not prompt:
            raise RequestRejected("prompt is empty")
        limit = self.model.max_total_tokens
        if len(prompt) >= limit:
            raise RequestRejected(self._too_long(len(prompt)))
        seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED)
        reqs = []
        for index in range(params.n):
            # The prompt's log-probabilities are the same for every sample: one computes them.
            sample_params = params if index == 0 else _without_prompt_logprobs(params)
            self._next_id += 1
            reqs.append(
                Request(
                    request_id=self._next_id,
                    prompt_token_ids=prompt,
                    params=sample_params,
                    seed=_sample_seed(seed, index),
                    max_total_tokens=limit,
                    eos_token_ids=self.model.eos_token_ids,
                    sample_index=index,
                    grammar=grammars[index],
                )
            )
        return reqs

    def _grammars(self, params: SamplingParams) -> list[TokenGrammar | None]:
        """Each sample's matcher of the job's constraint, compiled once (on the preparation
        thread: a large schema takes a while)."""
        spec = params.structured_output
        assert spec is not None and isinstance(self.grammars, Grammars)  # _check_params
        try:
            first = self.grammars.start(spec)
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        return [first, *(first.copy() for _ in range(params.n - 1))]

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.model.vocab_size
        for what, ids in (
            ("stop token id", params.stop_token_ids),
            ("logit_bias token id", [token for token, _ in params.logit_bias]),
        ):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise RequestRejected(f"{what} {bad} is outside the vocabulary [0, {vocab})")

    def _checked_ids(self, prompt: list[int]) -> list[int]:
        vocab = self.model.vocab_size
        if prompt and not 0 <= min(prompt) <= max(prompt) < vocab:
            bad = next(t for t in prompt if not 0 <= t < vocab)
            raise RequestRejected(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        return prompt

    # --- outbound -----------------------------------------------------------------------

    def publish(self, updates: list[RequestUpdate]) -> None:
        """Stream a step's new tokens and text: one frame per client, then one per finished
        sample. Stop strings found in the text finish their samples here."""
        self.num_steps += 1
        self.num_generation_tokens += len(updates)
        by_client: dict[bytes, list[_Entry]] = {}
        finished = []
        job_of = self._job_of
        for update in updates:
            req = update.req
            job = job_of.get(req.request_id)
            if job is None:
                continue
            # Judged by the update, not by the request: a later step may have been applied
            # already, and finished it with a token still to stream.
            done = update.finished
            end = TokenEnd.MORE
            if done:
                # A finishing update holds the request's last output: the outputs count up
                # to it.
                ends = req.ends_on(update.token_id, len(req.output_token_ids))
                end = TokenEnd.STOP_TOKEN if ends else TokenEnd.LAST
            delta = None
            text = job.texts.get(req.request_id) if job.texts else None
            if text is not None:
                # vLLM's: the EOS or stop token that ends a sample adds no text.
                delta = text.add(update.token_id, stop_terminated=end is TokenEnd.STOP_TOKEN)
                if text.stopped_by is not None:
                    self._stop_on_string(req, text.stopped_by)
                    done, end = True, TokenEnd.LAST
                elif done:  # its last token: the text held back for stop strings goes with it
                    delta += text.release()
            if req.params.prompt_logprobs is not None and not job.prompt_logprobs_sent:
                job.prompt_logprobs_sent = True  # complete with the prompt's last chunk
                self._send(job.origin.identity, _prompt_logprobs_frame(job, req))
            identity = job.origin.identity
            entries = by_client.get(identity)
            if entries is None:
                entries = by_client[identity] = []
            entries.append((job, update, delta, end))
            if done:
                finished.append(req)
        for identity, entries in by_client.items():
            self._send(identity, _tokens_frame(entries))
        for req in finished:
            self._finish(req)

    def _stop_on_string(self, req: Request, stop: str) -> None:
        if req.is_finished:  # its last token also reached a length limit: the stop wins
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        req.stop_reason = stop

    def _finish(self, req: Request) -> None:
        job = self._job_of.pop(req.request_id, None)
        if job is None:
            return
        job.open.discard(req.request_id)
        if not job.open:
            del self._jobs[job.origin]
        text = job.texts.pop(req.request_id, None)
        final_text = None
        if text is not None:
            text.release()
            final_text = text.text
        reason = cast(FinishReasonName, FINISH_REASONS[req.status].value)
        queued_ns = (req.first_scheduled_ns or req.arrival_ns) - req.arrival_ns
        self._send(
            job.origin.identity,
            Finished(
                job.origin.client_request_id,
                reason,
                final_text,
                req.num_prompt_tokens,
                index=req.sample_index,
                stop_reason=req.stop_reason,
                queue_time_s=queued_ns / 1e9,
                num_cached_tokens=req.num_cached_tokens,
            ),
        )

    def fail_everything(self, reason: str) -> None:
        """The engine cannot go on: every job gets an engine error, and so will new ones."""
        self.failure = reason
        self.scheduler.fail_all()
        for origin, message in self._preparing.items():
            self._send(origin.identity, Error(message.request_id, ErrorKind.ENGINE, reason))
        self._preparing.clear()
        for job in self._jobs.values():
            self._send(
                job.origin.identity, Error(job.origin.client_request_id, ErrorKind.ENGINE, reason)
            )
        self._jobs.clear()
        self._job_of.clear()

    def _send(self, identity: bytes, message: Message) -> None:
        try:
            self.socket.send_multipart([identity, encode(message)], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("client %s is not reading; dropped a %s", identity.hex(), message.TYPE)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            # The client is gone (it died, or its connection timed out): nobody will read
            # its jobs' tokens.
            self._gone.add(identity)

    def cancel_gone_clients(self) -> None:
        """Cancel the jobs of clients whose connections are gone (found by failed sends)."""
        while self._gone:
            self._drop_client(self._gone.pop(), "is gone")


def _sample_seed(seed: int, index: int) -> int:
    """Sample 0 keeps the job's seed; the others get seeds of their own derived from it, so a
    seeded job of n samples is reproducible and its samples differ."""
    if index == 0:
        return seed
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & _MASK64


def _without_prompt_logprobs(params: SamplingParams) -> SamplingParams:
    if params.prompt_logprobs is None:
        return params
    return dataclasses.replace(params, prompt_logprobs=None)


def _prompt_logprobs_frame(job: Job, req: Request) -> PromptLogprobs:
    buffer = req.prompt_logprobs
    if buffer is None or buffer.top_ids is None or buffer.top_logprobs is None:
        empty: list[list[Any]] = []
        return PromptLogprobs(job.origin.client_request_id, req.prompt_token_ids, [], empty, empty)
    return PromptLogprobs(
        job.origin.client_request_id,
        req.prompt_token_ids,
        buffer.logprobs[1:].tolist(),
        buffer.top_ids[1:].tolist(),
        buffer.top_logprobs[1:].tolist(),
    )


# A client's share of a step, an entry per sample that moved: its job, its update, the text
# it adds (None: the job is not detokenized here) and how it leaves the sample.
_Entry = tuple[Job, RequestUpdate, str | None, TokenEnd]


def _tokens_frame(entries: list[_Entry]) -> Tokens:
    """One client's share of a step as one ``Tokens`` frame; optional columns only when a job
    in it asked for them, or (``ends``) a sample in it ends."""
    # Columns by transposing, in C: one frame may hold every sequence of a step.
    jobs, updates, texts, ends = zip(*entries, strict=True)
    reqs, token_ids, logprobs, tops, _ = zip(*updates, strict=True)
    indices = [req.sample_index for req in reqs]
    with_logprobs = [req.params.logprobs is not None for req in reqs]
    with_top = tops.count(None) < len(tops)
    return Tokens(
        request_ids=[job.origin.client_request_id for job in jobs],
        token_ids=[[token_id] for token_id in token_ids],
        indices=indices if any(indices) else None,
        texts=[text or "" for text in texts] if texts.count(None) < len(texts) else None,
        logprobs=[
            [logprob] if wanted else []
            for logprob, wanted in zip(logprobs, with_logprobs, strict=True)
        ]
        if any(with_logprobs)
        else None,
        top_ids=[[top[0].tolist()] if top is not None else [] for top in tops]
        if with_top
        else None,
        top_logprobs=[[top[1].tolist()] if top is not None else [] for top in tops]
        if with_top
        else None,
        ends=list(ends) if any(ends) else None,
    )
