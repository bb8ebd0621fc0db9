"""The scheduling policy: which requests run in the next step, and what their results mean.

Pure: no sockets, no shared memory, no clock. ``schedule()`` returns a ``StepPlan``;
``update(plan, output)`` applies the worker's results for that plan, a ``StepOutput``; the
one way a request ends is ``finish(req, status)``. With asynchronous scheduling,
``schedule()`` for step N+1 runs before ``update()`` for step N (and, three steps deep, for
step N+2 before ``update()`` for N): requests in step N have a pending token, and their rows
in N+1 carry it over on the device. Carry-over reads only the previous step's
samples, so a request whose pending token comes from an older step waits for its result.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from cbpipe.scheduler.block_manager import BlockManager, BlockTables
from cbpipe.scheduler.request import NEVER, Request, RequestStatus

# A named tuple's generated ``__new__`` is Python code; ``tuple.__new__(cls, values)`` builds
# the same object in C. The scheduler makes a ``ScheduledSeq`` and a ``RequestUpdate`` per
# sequence per step with it.
_new_tuple = tuple.__new__
# Looking a member up on its enum class costs several times a module constant's lookup; the
# per-sequence loops compare against these.
_RUNNING = RequestStatus.RUNNING
_FIRST_FINISHED = RequestStatus.FINISHED_STOPPED


class ScheduledSeq(NamedTuple):
    """One request's share of a step: ``num_query_tokens`` rows starting at ``start``.

    A named tuple, not a frozen dataclass: one is made per sequence per step, and a frozen
    dataclass's ``__init__`` costs about three times as much.
    """

    req: Request
    start: int  # position of the first row
    num_query_tokens: int
    samples: bool  # the rows reach the end of the request's tokens, so a token is sampled
    carry_src: int | None  # seq index in the previous step whose sampled id is row 0's token
    output_index: int  # index among the request's outputs of the token sampled here
    prompt_logprobs: bool  # the rows' logits give prompt log-probabilities


@dataclass
class StepPlan:
    """Everything the packer needs for one step; seqs of one query token come first."""

    step: int
    seqs: list[ScheduledSeq]
    preempted: list[Request] = field(default_factory=list)
    # Requests that took a block-table row in this step (new, or resumed after preemption),
    # and of those the ones running for the first time.
    assigned: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    # Row ``seq.req.table_row`` holds each sequence's block ids (the scheduler's BlockTables).
    block_tables: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))

    @property
    def num_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.seqs)

    @property
    def num_single_token_seqs(self) -> int:
        return sum(1 for s in self.seqs if s.num_query_tokens == 1)


@dataclass
class StepOutput:
    """What the worker produced for one step, row ``i`` for ``plan.seqs[i]``.

    The optional parts are there when the step asked for them (``Step.top_logprobs``,
    ``Step.prompt_logprobs``); tests build one from ids alone with ``of_ids``.
    """

    sampled_ids: npt.NDArray[np.int64]  # [num_seqs]
    sampled_logprobs: npt.NDArray[np.float32]  # [num_seqs]
    top_ids: npt.NDArray[np.int32] | None = None  # [num_seqs, MAX_TOP_LOGPROBS]
    top_logprobs: npt.NDArray[np.float32] | None = None
    # Per token row of the step: [num_tokens] and [num_tokens, MAX_TOP_LOGPROBS].
    prompt_logprobs: npt.NDArray[np.float32] | None = None
    prompt_top_ids: npt.NDArray[np.int32] | None = None
    prompt_top_logprobs: npt.NDArray[np.float32] | None = None

    @classmethod
    def of_ids(cls, ids: Sequence[int]) -> StepOutput:
        return cls(np.asarray(ids, np.int64), np.zeros(len(ids), np.float32))


class RequestUpdate(NamedTuple):
    """What one step changed for one request: a new token and its log-probabilities, and
    whether the request finished (by its token or its length)."""

    req: Request
    token_id: int
    logprob: float
    top: tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]] | None  # its alternatives
    finished: bool


class Scheduler:
    """Continuous batching with a token budget, chunked prefill and preemption by recompute."""

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_batch_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        # Finished requests leave ``waiting`` lazily, when they reach its head: cancelling
        # one of many queued requests must not cost a scan of the queue.
        self.waiting: deque[Request] = deque()
        self.num_waiting = 0  # requests in ``waiting`` that are not finished
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.tables = BlockTables(max_num_seqs)
        self._next_step = 0
        self.num_preemptions = 0

    # --- requests in and out ------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.num_waiting += 1

    def cancel(self, request_id: int) -> Request | None:
        """Finish a request now and free its blocks; its rows in a step in flight are ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.finish(req, RequestStatus.FINISHED_CANCELLED)
        return req

    def fail_all(self) -> list[Request]:
        reqs = list(self.requests.values())
        for req in reqs:
            self.finish(req, RequestStatus.FINISHED_ERROR)
        return reqs

    @property
    def has_work(self) -> bool:
        """Whether ``schedule()`` can plan something now (admission takes the head of the
        queue only, so nothing behind it counts)."""
        head = self._first_waiting()
        return any(self._can_schedule(r) for r in self.running) or (
            head is not None and head.num_pending_tokens == 0
        )

    @property
    def is_idle(self) -> bool:
        return not self.requests

    # --- one step -----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan the next step; any number of earlier steps may still be unresolved."""
        step = self._next_step
        self._next_step += 1
        preempted: list[Request] = []
        assigned: list[Request] = []
        admitted: list[Request] = []
        # Rows of one query token first: the worker attends to them as one decode batch. A
        # decode's place is known when it is chosen, so it is committed at once; the longer
        # rows follow every decode, running requests' before admitted ones'.
        seqs: list[ScheduledSeq] = []
        chunks: list[tuple[Request, int]] = []
        budget = self._schedule_running(step, seqs, chunks, preempted)
        admissions: list[tuple[Request, int]] = []
        self._admit_waiting(budget, admissions, assigned, admitted)
        for req, num_new in admissions:
            if num_new == 1:
                seqs.append(self._commit(req, 1, step, len(seqs)))
            else:
                chunks.append((req, num_new))
        for req, num_new in chunks:
            seqs.append(self._commit(req, num_new, step, len(seqs)))
        return StepPlan(step, seqs, preempted, assigned, admitted, self.tables.rows)

    def _schedule_running(
        self,
        step: int,
        decodes: list[ScheduledSeq],
        chunks: list[tuple[Request, int]],
        preempted: list[Request],
    ) -> int:
        """Choose among the running requests, in order, while the token budget lasts: commit
        the decodes into ``decodes``, collect the longer rows in ``chunks``; returns the budget
        left. It runs for every sequence of every step, so the tests of ``_can_schedule`` and
        ``_reserve_blocks``'s room check are inlined, on counters read once."""
        budget = self.max_batch_tokens
        block_size = self.blocks.block_size
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not _RUNNING:
                continue
            num_pending = req.num_pending_tokens
            num_tokens = req.num_known_tokens + num_pending
            num_computed = req.num_computed_tokens
            num_to_compute = num_tokens - num_computed
            if num_to_compute <= 0:
                continue
            if num_to_compute == 1 and num_computed > 0 and num_tokens >= req.max_num_tokens:
                continue  # decoding: it would only sample a token the length limits forbid
            if num_pending and (req.pending_step != step - 1 or req.grammar is not None):
                # Left out of the last step: its token is not there to carry over. A
                # constrained request's mask needs the token itself (``structured.py``).
                continue
            num_new = num_to_compute if num_to_compute <= budget else budget
            if num_computed + num_new > len(req.block_ids) * block_size and not (
                self._reserve_blocks(req, num_new, preempted)
            ):
                continue  # req itself was preempted
            # Inlined check: a block is complete.
            if req.num_known_tokens >= req.publish_at <= num_computed + num_new:
                self._publish(req, num_computed + num_new)
            budget -= num_new
            if num_new == 1:
                # Committed now: preemption takes the newest running requests, never one
                # chosen before this one, so the commit stands.
                decodes.append(self._commit(req, 1, step, len(decodes)))
            else:
                chunks.append((req, num_new))
        return budget

    def update(self, plan: StepPlan, output: StepOutput) -> list[RequestUpdate]:
        """Apply step ``plan``'s results (one row per seq, in plan order)."""
        updates = []
        ids = output.sampled_ids.tolist()  # Python ints: one conversion, not one per seq
        logprobs = output.sampled_logprobs.tolist()
        if output.prompt_logprobs is not None:
            self._collect_prompt_logprobs(plan, output)
        top_ids, top_logprobs = output.top_ids, output.top_logprobs
        for index, seq in enumerate(plan.seqs):
            if not seq.samples:
                continue
            req = seq.req
            if req.status >= _FIRST_FINISHED:
                continue  # finished or cancelled while this step ran: a wasted row
            token_id = ids[index]
            finished_as = req.accept_sampled(token_id)
            if finished_as is not None:
                self.finish(req, finished_as)
            top = None
            if top_ids is not None and req.params.logprobs:
                assert top_logprobs is not None
                k = req.params.logprobs
                top = (top_ids[index, :k], top_logprobs[index, :k])
            updates.append(
                _new_tuple(
                    RequestUpdate, (req, token_id, logprobs[index], top, finished_as is not None)
                )
            )
        return updates

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End ``req`` as ``status`` and free what it holds; its rows in steps still in flight
        are wasted. The one way a request ends, whoever decides it (its token, its length,
        a stop string in its text, a cancel); finishing twice is a no-op."""
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.tables.release(req)
        else:  # waiting: it leaves the queue when it reaches the head
            self.num_waiting -= 1
        req.status = status
        self.blocks.free(req.block_ids)
        self.requests.pop(req.request_id, None)

    # --- helpers ------------------------------------------------------------------------

    def _admit_waiting(
        self,
        budget: int,
        chosen: list[tuple[Request, int]],
        assigned: list[Request],
        admitted: list[Request],
    ) -> int:
        """Start queued requests, head first, while the budget, the sequence limit and the
        free blocks allow; returns the budget left."""
        while budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._first_waiting()
            if req is None:
                break
            if req.num_pending_tokens:
                break  # its last token is still on the worker; recompute starts once it is back
            cached = self._cached_prefix(req)
            start = len(cached) * self.blocks.block_size
            num_new = min(req.num_tokens - start, budget)
            needed = self.blocks.blocks_for(start + num_new) - len(cached)
            if needed + self.blocks.num_evictable(cached) > self.blocks.num_free_blocks:
                break
            self.waiting.popleft()
            self.num_waiting -= 1
            self.blocks.record_lookup(req.num_tokens, start)
            self.blocks.take(cached)
            req.block_ids.extend(cached)
            req.num_computed_tokens = start
            req.num_published_blocks = len(cached)
            self.blocks.grow(req.block_ids, start + num_new)
            self._publish(req, start + num_new)
            if req.status is RequestStatus.WAITING:
                admitted.append(req)
                req.num_cached_tokens = start
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.tables.assign(req)
            assigned.append(req)
            chosen.append((req, num_new))
            budget -= num_new
        return budget

    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks ``req`` may start after: the longest cached run of its full
        blocks, short of its last token, which must be computed for a token to be sampled."""
        if not self.blocks.prefix_caching or not req.reads_prefix_cache:
            return []
        return self.blocks.match(
            req.hashes_of_full_blocks(self.blocks.block_size, req.num_tokens - 1)
        )

    def _publish(self, req: Request, num_computed: int) -> None:
        """Publish ``req``'s blocks that are full of known tokens whose keys and values are
        written by a step planned by now (``num_computed`` once this one is counted)."""
        bs = self.blocks.block_size
        if not self.blocks.prefix_caching:
            req.publish_at = NEVER  # nothing to publish: the inline check stays false
            return
        full = min(num_computed, req.num_known_tokens) // bs
        if full > req.num_published_blocks:
            req.hash_full_blocks(bs, full * bs)
            hashes = req.block_hashes  # not a copy: a decode publishes one block of many
            for index in range(req.num_published_blocks, full):
                self.blocks.publish(req.block_ids[index], hashes[index])
            req.num_published_blocks = full
        req.publish_at = (req.num_published_blocks + 1) * bs

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless block and request bookkeeping agree (tests)."""
        self.blocks.check(r.block_ids for r in self.running)
        assert all(not r.block_ids for r in self.waiting if not r.is_finished)
        if self.is_idle:
            assert self.blocks.num_free_blocks == self.blocks.num_blocks, "blocks leaked"

    def _first_waiting(self) -> Request | None:
        """The head of the queue, once the finished requests before it are dropped."""
        while self.waiting and self.waiting[0].is_finished:
            self.waiting.popleft()
        return self.waiting[0] if self.waiting else None

    def _can_schedule(self, req: Request) -> bool:
        """Whether ``req`` has tokens to compute (inlined in ``_schedule_running``)."""
        num_to_compute = req.num_tokens_to_compute
        if num_to_compute <= 0:
            return False
        if req.num_pending_tokens and req.grammar is not None:
            return False  # its next mask waits for the token in flight
        # Every token is computed but the last; computing it would only sample a token that
        # the length limits already forbid.
        decoding = num_to_compute == 1 and req.num_computed_tokens > 0
        return req.may_sample_more or not decoding

    def _reserve_blocks(self, req: Request, num_new: int, preempted: list[Request]) -> bool:
        """Grow ``req``'s table for ``num_new`` tokens, preempting the newest requests if needed."""
        total = req.num_computed_tokens + num_new
        while not self.blocks.try_grow(req.block_ids, total):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        self.tables.sync(req)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.tables.release(req)
        self.blocks.free(req.block_ids)
        req.num_computed_tokens = 0
        req.num_published_blocks = 0
        req.publish_at = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_waiting += 1

    def _commit(self, req: Request, num_new: int, step: int, seq_index: int) -> ScheduledSeq:
        """Count ``num_new`` of ``req``'s tokens as computed by ``step``, where it is sequence
        ``seq_index``."""
        start = req.num_computed_tokens
        num_pending = req.num_pending_tokens
        carry_src = None
        if num_pending:
            # Only a decode row can need a pending token: the newest, from the previous step
            # (``schedule`` leaves out a request whose token is older).
            assert num_new == 1 and start == req.num_known_tokens + num_pending - 1
            carry_src = req.pending_seq_index
        req.num_computed_tokens = start + num_new
        output_index = len(req.output_token_ids) + num_pending  # outputs known or sampling
        samples = start + num_new == req.num_known_tokens + num_pending
        if samples:
            req.num_pending_tokens = num_pending + 1
            req.pending_seq_index = seq_index
            req.pending_step = step
        buffer = req.prompt_logprobs
        prompt_logprobs = (
            buffer is not None and not buffer.complete and start < req.num_prompt_tokens - 1
        )
        return _new_tuple(
            ScheduledSeq, (req, start, num_new, samples, carry_src, output_index, prompt_logprobs)
        )

    def _collect_prompt_logprobs(self, plan: StepPlan, output: StepOutput) -> None:
        """Each prompt row's log-probability of the prompt token after it (the last prompt
        token's row samples the first output instead)."""
        assert output.prompt_logprobs is not None
        assert output.prompt_top_ids is not None and output.prompt_top_logprobs is not None
        row = 0
        for seq in plan.seqs:
            rows = slice(row, row + seq.num_query_tokens)
            row += seq.num_query_tokens
            buffer = seq.req.prompt_logprobs
            if not seq.prompt_logprobs or buffer is None:
                continue
            k = seq.req.params.prompt_logprobs or 0
            end = min(seq.num_query_tokens, seq.req.num_prompt_tokens - 1 - seq.start)
            positions = np.arange(seq.start, seq.start + end)
            keep = slice(rows.start, rows.start + end)
            buffer.write(
                positions,
                output.prompt_logprobs[keep],
                output.prompt_top_ids[keep, :k],
                output.prompt_top_logprobs[keep, :k],
            )
