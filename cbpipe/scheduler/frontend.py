"""The client-facing half of the scheduler: validating jobs, mapping ids, replying.

Clients talk to a ROUTER socket; every frame arrives with the client's identity. A job is
known to the client by its own ``request_id`` and to the scheduler core by an engine-wide id.
Every way a frame can be wrong ends here as an ``Error`` reply (or a dropped frame when no
client can be named); nothing that a client sends can reach the core unvalidated.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import zmq

from cbpipe.protocol.messages import (
    Cancel,
    Error,
    ErrorKind,
    Finished,
    FinishReasonName,
    GetStats,
    Goodbye,
    Hello,
    Message,
    ProtocolError,
    Stats,
    Submit,
    Tokens,
    Welcome,
    decode,
    encode,
    request_id_of,
)
from cbpipe.protocol.sampling import MAX_SEED
from cbpipe.scheduler.core import RequestUpdate, Scheduler
from cbpipe.scheduler.request import FINISH_REASONS, Request

log = logging.getLogger("cbpipe.scheduler")


class RequestRejected(ValueError):
    """A job that cannot be served; the message is sent to the client as is."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    max_total_tokens: int  # prompt + outputs, bounded by the model and the KV cache
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class Origin:
    identity: bytes
    client_request_id: int


class Frontend:
    def __init__(
        self,
        socket: zmq.Socket,
        scheduler: Scheduler,
        model: ModelInfo,
        tokenizer: object | None,
    ) -> None:
        self.socket = socket
        self.scheduler = scheduler
        self.model = model
        self.tokenizer = tokenizer
        self.failure: str | None = None  # set once the engine cannot serve any more
        self._origins: dict[int, Origin] = {}
        self._engine_ids: dict[Origin, int] = {}
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
        """Handle one multipart frame waiting on the socket."""
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
        self._handlers[type(message)](identity, message)

    def _on_hello(self, identity: bytes, message: Message) -> None:
        self._send(
            identity,
            Welcome(
                self.model.name,
                self.model.vocab_size,
                self.model.max_total_tokens,
                self.tokenizer is not None,
            ),
        )

    def _on_submit(self, identity: bytes, message: Message) -> None:
        assert isinstance(message, Submit)
        origin = Origin(identity, message.request_id)
        if self.failure is not None:
            self._send(identity, Error(message.request_id, ErrorKind.ENGINE, self.failure))
            return
        try:
            req = self._make_request(origin, message)
        except RequestRejected as exc:
            self._send(identity, Error(message.request_id, ErrorKind.REQUEST, str(exc)))
            return
        self._origins[req.request_id] = origin
        self._engine_ids[origin] = req.request_id
        req.arrival_ns = time.perf_counter_ns()
        self.num_prompt_tokens += req.num_prompt_tokens
        self.scheduler.add_request(req)

    def _on_cancel(self, identity: bytes, message: Message) -> None:
        assert isinstance(message, Cancel)
        engine_id = self._engine_ids.get(Origin(identity, message.request_id))
        if engine_id is None:
            return  # already finished: the client has or will get its Finished
        req = self.scheduler.cancel(engine_id)
        if req is not None:
            self._finish(req)

    def _on_get_stats(self, identity: bytes, message: Message) -> None:
        scheduler = self.scheduler
        blocks = scheduler.blocks
        self._send(
            identity,
            Stats(
                num_running=len(scheduler.running),
                num_waiting=len(scheduler.waiting),
                kv_cache_usage=1.0 - blocks.num_free_blocks / blocks.num_blocks,
                num_prompt_tokens=self.num_prompt_tokens,
                num_generation_tokens=self.num_generation_tokens,
                num_preemptions=scheduler.num_preemptions,
                num_steps=self.num_steps,
            ),
        )

    def _on_goodbye(self, identity: bytes, message: Message) -> None:
        """The client is closing and nobody will read these jobs' tokens: stop them now."""
        orphans = [eid for origin, eid in self._engine_ids.items() if origin.identity == identity]
        for engine_id in orphans:
            req = self.scheduler.cancel(engine_id)
            if req is not None:
                self._finish(req)
        if orphans:
            log.info("client %s closed: cancelled %d jobs", identity.hex(), len(orphans))

    def _make_request(self, origin: Origin, message: Submit) -> Request:
        if origin in self._engine_ids:
            raise RequestRejected(f"request_id {message.request_id} is already in use")
        params = message.params
        try:
            params.validate()
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        prompt = self._prompt_tokens(message.prompt)
        vocab = self.model.vocab_size
        for token_id in params.stop_token_ids:
            if token_id >= vocab:
                raise RequestRejected(
                    f"stop token id {token_id} is outside the vocabulary [0, {vocab})"
                )
        limit = self.model.max_total_tokens
        if len(prompt) >= limit:
            raise RequestRejected(
                f"prompt of {len(prompt)} tokens is too long: this engine holds at most "
                f"{limit} tokens per sequence, prompt and output together"
            )
        self._next_id += 1
        return Request(
            request_id=self._next_id,
            prompt_token_ids=prompt,
            params=params,
            seed=params.seed if params.seed is not None else secrets.randbelow(MAX_SEED),
            max_total_tokens=limit,
            eos_token_ids=self.model.eos_token_ids,
        )

    def _prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected(
                    f"model {self.model.name} has no tokenizer: send the prompt as token ids"
                )
            tokens = list(self.tokenizer(prompt, add_special_tokens=False).input_ids)  # type: ignore[operator]
        else:
            tokens = prompt
            vocab = self.model.vocab_size
            bad = next((t for t in tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestRejected(
                    f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
                )
        if not tokens:
            raise RequestRejected("prompt is empty")
        return tokens

    # --- outbound -----------------------------------------------------------------------

    def publish(self, updates: list[RequestUpdate]) -> None:
        """Stream a step's new tokens: one frame per client, then one per finished job."""
        self.num_steps += 1
        self.num_generation_tokens += len(updates)
        by_client: dict[bytes, list[tuple[Origin, RequestUpdate]]] = {}
        for update in updates:
            origin = self._origins.get(update.req.request_id)
            if origin is not None:
                by_client.setdefault(origin.identity, []).append((origin, update))
        for identity, entries in by_client.items():
            self._send(identity, _tokens_frame(entries))
        for update in updates:
            if update.finished:
                self._finish(update.req)

    def _finish(self, req: Request) -> None:
        origin = self._origins.pop(req.request_id, None)
        if origin is None:
            return
        del self._engine_ids[origin]
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        reason = cast(FinishReasonName, FINISH_REASONS[req.status].value)
        queued_ns = (req.first_scheduled_ns or req.arrival_ns) - req.arrival_ns
        self._send(
            origin.identity,
            Finished(
                origin.client_request_id,
                reason,
                text,
                req.num_prompt_tokens,
                index=req.sample_index,
                stop_reason=req.stop_reason,
                queue_time_s=queued_ns / 1e9,
            ),
        )

    def fail_everything(self, reason: str) -> None:
        """The engine cannot go on: every job gets an engine error, and so will new ones."""
        self.failure = reason
        for req in self.scheduler.fail_all():
            origin = self._origins.pop(req.request_id, None)
            if origin is not None:
                del self._engine_ids[origin]
                self._send(
                    origin.identity, Error(origin.client_request_id, ErrorKind.ENGINE, reason)
                )

    def _send(self, identity: bytes, message: Message) -> None:
        try:
            self.socket.send_multipart([identity, encode(message)], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("client %s is not reading; dropped a %s", identity.hex(), message.TYPE)


def _tokens_frame(entries: list[tuple[Origin, RequestUpdate]]) -> Tokens:
    """One client's share of a step as one ``Tokens`` frame; optional columns only when a job
    in it asked for them."""
    updates = [u for _, u in entries]
    with_logprobs = any(u.req.params.logprobs is not None for u in updates)
    with_top = any(u.top is not None for u in updates)
    with_indices = any(u.req.sample_index for u in updates)
    return Tokens(
        request_ids=[origin.client_request_id for origin, _ in entries],
        token_ids=[[u.token_id] for u in updates],
        indices=[u.req.sample_index for u in updates] if with_indices else None,
        logprobs=[[u.logprob] if u.req.params.logprobs is not None else [] for u in updates]
        if with_logprobs
        else None,
        top_ids=[[u.top[0].tolist()] if u.top is not None else [] for u in updates]
        if with_top
        else None,
        top_logprobs=[[u.top[1].tolist()] if u.top is not None else [] for u in updates]
        if with_top
        else None,
    )
