"""A request's state as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cbpipe.protocol.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every finished state compares >= FINISHED_STOPPED."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_CANCELLED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_CANCELLED: FinishReason.CANCELLED,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False)
class Request:
    """One generation job.

    Token accounting with steps in flight: ``num_tokens`` counts prompt tokens, known outputs
    and outputs sampled by steps still running on the worker (``num_pending_tokens``).
    ``num_computed_tokens`` counts tokens whose KV entries are written, or will be by a step
    already sent, so the scheduler can plan the next step before the last one is back. While
    step N+1 is planned and step N is not yet applied, a decoding request has two pending
    tokens (three, when N+2 is planned before N is applied); a row carries over only the
    newest, sampled by the previous step.
    """

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_total_tokens: int  # prompt + outputs may not exceed this (model length, cache size)
    eos_token_ids: frozenset[int]
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    # The step that samples the newest pending token, and this request's row (sequence
    # index) in it.
    pending_step: int | None = None
    pending_seq_index: int | None = None
    block_ids: list[int] = field(default_factory=list)
    table_row: int | None = None  # its row in the scheduler's BlockTables while running
    num_known_tokens: int = field(init=False)
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        # Prompt plus outputs, counted rather than measured: the scheduler reads it several
        # times per request per step. Outputs grow only through ``append_output``.
        self.num_known_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.num_known_tokens += 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known_tokens + self.num_pending_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_outputs_planned(self) -> int:
        """Outputs known or already being sampled."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def may_sample_more(self) -> bool:
        """Whether another token may be sampled, judged by length limits alone."""
        return (
            self.num_outputs_planned < self.params.max_new_tokens
            and self.num_tokens < self.max_total_tokens
        )

    def token_at(self, position: int) -> int:
        if position < len(self.prompt_token_ids):
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - len(self.prompt_token_ids)]

    def known_tokens(self, start: int, stop: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        head = self.prompt_token_ids[start:num_prompt] if start < num_prompt else []
        return head + self.output_token_ids[max(start - num_prompt, 0) : stop - num_prompt]

    def stop_reason_after(self, token_id: int) -> RequestStatus | None:
        """The finished state that appending ``token_id`` (already appended) leads to."""
        if token_id in self.params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.params.max_new_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_known_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
