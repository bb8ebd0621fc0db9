"""A request's state as the scheduler sees it."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from cbpipe.protocol.messages import SamplingMode
from cbpipe.protocol.sampling import SamplingParams
from cbpipe.scheduler.block_hashes import chain_hashes

if TYPE_CHECKING:
    from cbpipe.scheduler.structured import TokenGrammar

log = logging.getLogger(__name__)

NEVER = 1 << 62  # a token count no request reaches


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


@dataclass(eq=False, slots=True)
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
    # Prompt plus outputs never exceed this: max_new_tokens outputs, within max_total_tokens.
    max_num_tokens: int = field(init=False)
    # The tokens that end it: its stop tokens, and EOS unless it ignores EOS.
    end_token_ids: frozenset[int] = field(init=False)
    num_preemptions: int = 0
    sample_index: int = 0  # which of its job's ``n`` samples this request is
    # What stopped it, as vLLM has it: one of its stop token ids, or the stop string the text
    # stage matched; None at EOS or a length limit.
    stop_reason: int | str | None = None
    # Set by the process loop: when the request arrived and was first scheduled (host clock).
    arrival_ns: int = 0
    first_scheduled_ns: int | None = None
    # Prompt tokens the prefix cache held at its first admission: not computed for it.
    num_cached_tokens: int = 0
    sampling_mode: SamplingMode = field(init=False)
    prompt_logprobs: PromptLogprobsBuffer | None = field(init=False)
    # Prefix caching: hashes of the full blocks of known tokens, in order (computed as they
    # are needed), and how many of its table's blocks are published.
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0
    publish_at: int = 0  # tokens, known and computed, that complete its next block
    # Structured output: where its outputs are in its constraint's grammar. The scheduler
    # plans its sampling rows only once its last token is known, to compute their mask.
    grammar: TokenGrammar | None = None

    def __post_init__(self) -> None:
        # Prompt plus outputs, counted rather than measured: the scheduler reads it several
        # times per request per step. Outputs grow only through ``accept_sampled``.
        self.num_known_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)
        params = self.params
        self.max_num_tokens = min(
            len(self.prompt_token_ids) + params.max_new_tokens, self.max_total_tokens
        )
        ends = frozenset(params.stop_token_ids)
        self.end_token_ids = ends if params.ignore_eos else ends | self.eos_token_ids
        if params.needs_full_sampling:
            self.sampling_mode = SamplingMode.FULL
        elif params.is_greedy:
            self.sampling_mode = SamplingMode.GREEDY
        else:
            self.sampling_mode = SamplingMode.RANDOM
        self.prompt_logprobs = None
        if params.prompt_logprobs is not None and len(self.prompt_token_ids) > 1:
            self.prompt_logprobs = PromptLogprobsBuffer(len(self.prompt_token_ids))

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
    def may_sample_more(self) -> bool:
        """Whether another token may be sampled, judged by length limits alone."""
        return self.num_tokens < self.max_num_tokens

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

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether it may start after a cached prefix. Not when it wants the prompt's
        log-probabilities (a cached prefix is not computed), nor when the device keeps state
        built from its prompt's rows (the penalties' counts, the logit-bias row)."""
        params = self.params
        return (
            params.prompt_logprobs is None
            and not params.has_penalties
            and not params.logit_bias
            and not params.min_tokens
        )

    def hashes_of_full_blocks(self, block_size: int, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among its first ``num_tokens`` known tokens."""
        return self.block_hashes[: self.hash_full_blocks(block_size, num_tokens)]

    def hash_full_blocks(self, block_size: int, num_tokens: int) -> int:
        """Extend ``block_hashes`` over the full blocks among its first ``num_tokens`` known
        tokens; returns how many blocks that is (``block_hashes`` may hold more)."""
        count = min(num_tokens, self.num_known_tokens) // block_size
        done = len(self.block_hashes)
        if done < count:
            tokens = self.known_tokens(done * block_size, count * block_size)
            self.block_hashes += chain_hashes(
                self.block_hashes[-1] if done else None, tokens, block_size, self.params.cache_salt
            )
        return count

    @property
    def banned_until_min_tokens(self) -> tuple[int, ...]:
        """Tokens that would end the request, banned while it is short of ``min_tokens``."""
        return tuple(sorted(self.end_token_ids))

    def ends_on(self, token_id: int, num_outputs: int) -> bool:
        """Whether ``token_id``, as its ``num_outputs``-th output, ends it: EOS or one of its
        stop tokens, once past ``min_tokens`` outputs (the device bans them until then)."""
        return token_id in self.end_token_ids and num_outputs > self.params.min_tokens

    def accept_sampled(self, token_id: int) -> RequestStatus | None:
        """Take the token that its oldest pending row sampled as its next output; returns the
        finished state that the token leads to, if any."""
        self.num_pending_tokens -= 1
        if self.num_pending_tokens == 0:
            self.pending_seq_index = None
        self.output_token_ids.append(token_id)
        self.num_known_tokens += 1
        if self.grammar is not None and self.grammar.failed:
            # Its mask meant nothing (an EOS drawn from it is no whole match): an error.
            log.error(
                "request %d: structured output's grammar failed: %s",
                self.request_id,
                self.grammar.error,
            )
            return RequestStatus.FINISHED_ERROR
        if self.ends_on(token_id, len(self.output_token_ids)):
            # vLLM's: EOS (checked first) has no stop reason; a stop token is its own.
            at_eos = token_id in self.eos_token_ids and not self.params.ignore_eos
            self.stop_reason = None if at_eos else token_id
            return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None:
            if not self.grammar.accept(token_id):  # the mask allowed only what it accepts
                log.error(
                    "request %d: structured output's grammar refused token %d: %s",
                    self.request_id,
                    token_id,
                    self.grammar.error,
                )
                return RequestStatus.FINISHED_ERROR
            if self.grammar.is_complete:  # nothing may follow: the text is a whole match
                return RequestStatus.FINISHED_STOPPED
        if self.num_known_tokens >= self.max_num_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None


class PromptLogprobsBuffer:
    """Prompt log-probabilities as the steps of a prompt's chunks deliver them.

    Indexed by position: entry ``p`` is prompt token ``p``'s log-probability given the tokens
    before it, so position 0 has none. A prompt recomputed after a preemption delivers the
    same values again, which overwrite; ``complete`` once every position has one.
    """

    def __init__(self, num_prompt_tokens: int) -> None:
        self.logprobs = np.zeros(num_prompt_tokens, np.float32)
        self.top_ids: np.ndarray | None = None  # [num_prompt, k], allocated on first write
        self.top_logprobs: np.ndarray | None = None
        self._filled = np.zeros(num_prompt_tokens, bool)
        self._filled[0] = True
        self.sent = False

    @property
    def complete(self) -> bool:
        return bool(self._filled.all())

    def write(
        self,
        positions: np.ndarray,
        logprobs: np.ndarray,
        top_ids: np.ndarray,
        top_logprobs: np.ndarray,
    ) -> None:
        """Values predicted at ``positions``, which belong to the tokens one further on."""
        targets = positions + 1
        self.logprobs[targets] = logprobs
        if self.top_ids is None or self.top_logprobs is None:
            shape = (len(self.logprobs), top_ids.shape[1])
            self.top_ids = np.zeros(shape, np.int32)
            self.top_logprobs = np.zeros(shape, np.float32)
        self.top_ids[targets] = top_ids
        self.top_logprobs[targets] = top_logprobs
        self._filled[targets] = True
