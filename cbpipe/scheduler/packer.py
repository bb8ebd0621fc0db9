"""Writes a ``StepPlan`` into a slot and reads the step's outputs back.

This runs once per step on the scheduler's critical path, so the plan's sequences are
transposed into columns once (``SeqColumns``) and each field is written with one numpy
assignment, computed from those columns and the block-table rows; only prefill chunks (a few
per step, many rows each) are written slice by slice. What a request's rows need that never
changes while it runs (its sampling parameters) is written once, into a row of
``SamplingTable`` when it takes its block-table row, and gathered from there each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from cbpipe.protocol.messages import SamplingMode, Step
from cbpipe.protocol.sampling import MAX_TOP_LOGPROBS
from cbpipe.protocol.slots import SlotLayout, SlotViews, StepInputs, numpy_views
from cbpipe.scheduler.core import ScheduledSeq, StepOutput, StepPlan
from cbpipe.scheduler.request import Request
from cbpipe.scheduler.structured import TokenGrammar, fill_masks

_MODE_RANK = {SamplingMode.GREEDY: 0, SamplingMode.RANDOM: 1, SamplingMode.FULL: 2}
_MODES = sorted(_MODE_RANK, key=_MODE_RANK.__getitem__)
_table_row = attrgetter("table_row")


class SeqColumns(NamedTuple):
    """A plan's sequences field by field: ``ScheduledSeq``'s fields, transposed."""

    reqs: tuple[Request, ...]
    starts: tuple[int, ...]
    num_query_tokens: tuple[int, ...]
    samples: tuple[bool, ...]
    carry_srcs: tuple[int | None, ...]
    output_indices: tuple[int, ...]
    prompt_logprobs: tuple[bool, ...]

    @classmethod
    def of(cls, seqs: list[ScheduledSeq]) -> SeqColumns:
        return cls(*zip(*seqs, strict=True))


@dataclass
class SamplingTable:
    """Each running request's sampling parameters, one row per block-table row.

    ``gather(rows)`` columns go straight into a slot's per-sequence fields.
    """

    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    min_p: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray
    seed: np.ndarray
    num_prompt_tokens: np.ndarray
    mode_rank: np.ndarray  # the sampler the request needs, ranked as ``_MODE_RANK``
    top_logprobs: np.ndarray  # the request asks for top alternatives
    bias_state: np.ndarray  # the request has logit-bias entries or a min_tokens ban
    structured: np.ndarray  # the request's outputs follow a grammar: a mask where it samples
    prompt_logprobs: np.ndarray  # the request asks for prompt log-probabilities

    @classmethod
    def empty(cls, num_rows: int) -> SamplingTable:
        def column(dtype: type) -> np.ndarray:
            return np.zeros(num_rows, dtype)

        return cls(
            temperature=column(np.float32),
            top_p=column(np.float32),
            top_k=column(np.int32),
            min_p=column(np.float32),
            presence_penalty=column(np.float32),
            frequency_penalty=column(np.float32),
            repetition_penalty=column(np.float32),
            seed=column(np.int64),
            num_prompt_tokens=column(np.int32),
            mode_rank=column(np.int8),
            top_logprobs=column(np.bool_),
            bias_state=column(np.bool_),
            structured=column(np.bool_),
            prompt_logprobs=column(np.bool_),
        )

    def write(self, req: Request) -> None:
        row, p = req.table_row, req.params
        assert row is not None
        self.temperature[row] = p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k
        self.min_p[row] = p.min_p
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = p.repetition_penalty
        self.seed[row] = req.seed
        self.num_prompt_tokens[row] = req.num_prompt_tokens
        self.mode_rank[row] = _MODE_RANK[req.sampling_mode]
        self.top_logprobs[row] = bool(p.logprobs)
        self.structured[row] = req.grammar is not None
        # A constrained request's entries go with its masks, which rewrite its row.
        has_entries = bool(p.logit_bias) or p.min_tokens > 0
        self.bias_state[row] = has_entries and req.grammar is None
        self.prompt_logprobs[row] = req.prompt_logprobs is not None


# Slot fields copied from the table's columns of the same name.
_TABLE_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "num_prompt_tokens",
)


class BatchPacker:
    """Packs plans into the slots of one shared-memory segment (numpy views, no copies kept)."""

    def __init__(self, buffer: memoryview, layout: SlotLayout, block_size: int) -> None:
        self.layout = layout
        self.block_size = block_size
        self._views = [numpy_views(buffer, layout, slot) for slot in range(layout.num_slots)]
        self.table = SamplingTable.empty(layout.limits.max_seqs)

    def views(self, slot: int) -> SlotViews[np.ndarray]:
        return self._views[slot]

    def pack(self, plan: StepPlan, slot: int, previous_slot: int | None) -> Step:
        """Fill ``slot`` with ``plan`` and return the message that hands it to the worker.

        ``previous_slot`` holds the step sent just before this one; rows that carry a token
        over read that slot's sampled ids on the device.
        """
        views = self._views[slot]
        inputs = views.inputs
        seqs = plan.seqs
        if not seqs:
            raise ValueError(f"step {plan.step} has no sequences")
        columns = SeqColumns.of(seqs)
        lengths = columns.num_query_tokens
        num_seqs, num_tokens = len(seqs), sum(lengths)
        limits = self.layout.limits
        if num_seqs > limits.max_seqs or num_tokens > limits.max_tokens:
            raise ValueError(f"step {plan.step} exceeds the slot's capacity")
        num_carried = num_seqs - columns.carry_srcs.count(None)  # decodes only
        carries = num_carried > 0
        if carries and previous_slot is None:
            raise ValueError(f"step {plan.step} carries tokens over but no step came before it")
        for req in plan.assigned:
            self.table.write(req)

        rows = np.fromiter(map(_table_row, columns.reqs), dtype=np.intp, count=num_seqs)
        starts = np.array(columns.starts, np.int64)
        num_decodes = lengths.count(1)  # they come first
        self._pack_decode_rows(
            inputs, columns, starts[:num_decodes], rows, plan.block_tables, num_carried
        )
        row = num_decodes
        for index in range(num_decodes, num_seqs):
            row = self._pack_chunk_rows(views, seqs[index], row)
        width = self._pack_sequences(
            inputs, columns, starts, rows, plan.block_tables, plan.assigned
        )
        mode = _MODES[int(self.table.mode_rank[rows].max())]
        num_bias_entries = num_token_masks = 0
        if mode is SamplingMode.FULL and self.table.bias_state[rows].any():
            num_bias_entries = self._pack_bias_entries(views, seqs, rows)
        if mode is SamplingMode.FULL and self.table.structured[rows].any():
            num_token_masks, num_bias_entries = self._pack_token_masks(
                views, seqs, rows, num_bias_entries
            )
        prompt_logprobs = any(columns.prompt_logprobs[num_decodes:])
        if self.table.prompt_logprobs[rows[:num_decodes]].any():
            # A prompt chunk of one row sits among the decodes (a budget left at one token).
            prompt_logprobs |= self._pack_single_row_targets(views, seqs[:num_decodes])

        inputs.header[:] = (plan.step, num_tokens, num_seqs, width)
        return Step(
            step=plan.step,
            slot=slot,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            num_single_token_seqs=num_decodes,
            max_query_len=max(lengths),
            max_context_len=int(inputs.context_lens[:num_seqs].max()),
            block_table_width=width,
            carry_from_slot=previous_slot if carries else None,
            sampling=mode,
            top_logprobs=bool(self.table.top_logprobs[rows].any()),
            prompt_logprobs=prompt_logprobs,
            num_bias_entries=num_bias_entries,
            num_token_masks=num_token_masks,
        )

    def read_output(self, slot: int, step: Step) -> StepOutput:
        """The outputs of ``step``, copied out of ``slot`` (the slot is reused afterwards)."""
        out = self._views[slot].outputs
        n, t, k = step.num_seqs, step.num_tokens, MAX_TOP_LOGPROBS
        output = StepOutput(out.sampled_ids[:n].copy(), out.sampled_logprobs[:n].copy())
        if step.top_logprobs:
            output.top_ids = out.top_ids[: n * k].reshape(n, k).copy()
            output.top_logprobs = out.top_logprobs[: n * k].reshape(n, k).copy()
        if step.prompt_logprobs:
            output.prompt_logprobs = out.prompt_logprobs[:t].copy()
            output.prompt_top_ids = out.prompt_top_ids[: t * k].reshape(t, k).copy()
            output.prompt_top_logprobs = out.prompt_top_logprobs[: t * k].reshape(t, k).copy()
        return output

    def _pack_decode_rows(
        self,
        inputs: StepInputs[np.ndarray],
        columns: SeqColumns,
        starts: np.ndarray,
        rows: np.ndarray,
        block_tables: np.ndarray,
        num_carried: int,
    ) -> None:
        """The rows of one token (the first ``len(starts)`` sequences), seq i on row i;
        ``num_carried`` of them carry their token over."""
        n = len(starts)
        bs = self.block_size
        positions = inputs.positions[:n]
        positions[:] = starts
        # Each row's block, from its request's block-table row (which holds its block ids).
        blocks = block_tables[rows[:n], positions // bs]
        np.add(blocks * bs, positions % bs, out=inputs.slot_mapping[:n])
        carry_srcs = columns.carry_srcs[:n]
        if num_carried == n:  # every decode of an asynchronous step
            inputs.carry_mask[:n] = True
            inputs.carry_src[:n] = carry_srcs
            inputs.input_ids[:n] = 0  # ignored: the device takes the previous step's ids
            return
        inputs.carry_mask[:n] = [src is not None for src in carry_srcs]
        inputs.carry_src[:n] = [src or 0 for src in carry_srcs]  # 0: a valid unused index
        # A carried row's id is ignored: the device takes the previous step's sampled id.
        inputs.input_ids[:n] = [
            0 if src is not None else req.token_at(start)
            for req, start, src in zip(
                columns.reqs[:n], columns.starts[:n], carry_srcs, strict=True
            )
        ]

    def _pack_chunk_rows(self, views: SlotViews[np.ndarray], seq: ScheduledSeq, row: int) -> int:
        """A prefill chunk's rows, which start at ``row``; returns the row after them."""
        inputs = views.inputs
        end = row + seq.num_query_tokens
        positions = np.arange(seq.start, seq.start + seq.num_query_tokens)
        blocks = np.asarray(seq.req.block_ids, dtype=np.int64)
        inputs.positions[row:end] = positions
        inputs.slot_mapping[row:end] = (
            blocks[positions // self.block_size] * self.block_size + positions % self.block_size
        )
        inputs.carry_mask[row:end] = False
        inputs.carry_src[row:end] = 0
        inputs.input_ids[row:end] = seq.req.known_tokens(seq.start, seq.start + (end - row))
        if seq.prompt_logprobs:
            # Each row's target is the token after it; rows past the prompt's second-to-last
            # token have none (the last prompt row samples an output instead).
            targets = seq.req.known_tokens(seq.start + 1, seq.start + 1 + (end - row))
            views.extras.prompt_targets[row : row + len(targets)] = targets
        return end

    def _pack_single_row_targets(
        self, views: SlotViews[np.ndarray], seqs: list[ScheduledSeq]
    ) -> bool:
        """Prompt targets of the one-row sequences (on rows ``0..``) that want prompt
        log-probabilities; returns whether there was one."""
        found = False
        for row, seq in enumerate(seqs):
            if seq.prompt_logprobs:
                views.extras.prompt_targets[row] = seq.req.token_at(seq.start + 1)
                found = True
        return found

    def _pack_sequences(
        self,
        inputs: StepInputs[np.ndarray],
        columns: SeqColumns,
        starts: np.ndarray,
        rows: np.ndarray,
        block_tables: np.ndarray,
        assigned: list[Request],
    ) -> int:
        """Per-sequence fields and block tables; returns the block-table row width."""
        n = len(rows)
        lengths = np.array(columns.num_query_tokens, np.int64)
        inputs.query_start[0] = 0
        np.cumsum(lengths, out=inputs.query_start[1 : n + 1])
        context_lens = np.add(starts, lengths, out=inputs.context_lens[:n])
        inputs.output_index[:n] = columns.output_indices
        inputs.request_row[:n] = rows
        if any(columns.prompt_logprobs):
            inputs.has_prompt_logprobs[:n] = columns.prompt_logprobs
        else:
            inputs.has_prompt_logprobs[:n] = False
        if assigned:
            taken = np.fromiter((req.table_row for req in assigned), np.intp, len(assigned))
            inputs.resets_row[:n] = np.isin(rows, taken)
        else:
            inputs.resets_row[:n] = False
        for name in _TABLE_FIELDS:
            getattr(inputs, name)[:n] = getattr(self.table, name)[rows]
        # Each sequence's table holds the blocks of its context, no more.
        width = -(-int(context_lens.max()) // self.block_size)
        # Columns past a sequence's own blocks hold stale ids; context_lens keeps them unread.
        inputs.block_tables[: n * width].reshape(n, width)[:] = block_tables[rows, :width]
        return width

    def _pack_bias_entries(
        self, views: SlotViews[np.ndarray], seqs: list[ScheduledSeq], rows: np.ndarray
    ) -> int:
        """Logit-bias entries for the sequences whose device rows change in this step: on
        their first rows (the device has just reset their state) their logit_bias, and a ban
        of their ending tokens while short of min_tokens; lifted when the output that may end
        them is sampled. Returns the number of entries."""
        extras = views.extras
        count = 0
        resets = views.inputs.resets_row
        for index in np.flatnonzero(self.table.bias_state[rows]).tolist():
            seq = seqs[index]
            entries = _bias_entries(seq, bool(resets[index]))
            if not entries:
                continue
            end = count + len(entries)
            extras.bias_rows[count:end] = rows[index]
            extras.bias_token_ids[count:end] = [token for token, _ in entries]
            extras.bias_values[count:end] = [value for _, value in entries]
            count = end
        return count

    def _pack_token_masks(
        self, views: SlotViews[np.ndarray], seqs: list[ScheduledSeq], rows: np.ndarray, count: int
    ) -> tuple[int, int]:
        """The masks of the constrained sequences that sample in this step, and after their
        bias entries (from ``count`` on); returns the numbers of masks and of entries."""
        structured = np.flatnonzero(self.table.structured[rows]).tolist()
        sampling = [index for index in structured if seqs[index].samples]
        if not sampling:
            return 0, count
        extras, words = views.extras, self.layout.limits.mask_words
        n = len(sampling)
        extras.mask_seqs[:n] = sampling
        masks = extras.token_masks[: n * words].reshape(n, words)
        fill_masks([_grammar_of(seqs[index].req) for index in sampling], masks)
        for mask, index in zip(masks, sampling, strict=True):
            entries = _masked_bias_entries(seqs[index], mask)
            end = count + len(entries)
            extras.bias_rows[count:end] = rows[index]
            extras.bias_token_ids[count:end] = [token for token, _ in entries]
            extras.bias_values[count:end] = [value for _, value in entries]
            count = end
        return n, count


def _bias_entries(seq: ScheduledSeq, resets_row: bool) -> list[tuple[int, float]]:
    req, params = seq.req, seq.req.params
    entries: list[tuple[int, float]] = []
    if resets_row:
        entries.extend(params.logit_bias)
        if seq.output_index < params.min_tokens:
            entries.extend((token, float("-inf")) for token in req.banned_until_min_tokens)
    elif seq.samples and params.min_tokens and seq.output_index == params.min_tokens:
        bias = dict(params.logit_bias)
        entries.extend((token, bias.get(token, 0.0)) for token in req.banned_until_min_tokens)
    return entries


def _masked_bias_entries(seq: ScheduledSeq, mask: np.ndarray) -> list[tuple[int, float]]:
    """A constrained sequence's bias entries under its step's mask, which has just reset its
    row: its logit_bias where the mask allows the token, and the ban of its ending tokens
    while short of min_tokens, unless the grammar allows nothing else (the grammar wins)."""
    req, params = seq.req, seq.req.params

    def allowed(token: int) -> bool:
        word = token >> 5
        return word < len(mask) and bool((int(mask[word]) >> (token & 31)) & 1)

    entries = [(token, value) for token, value in params.logit_bias if allowed(token)]
    if seq.output_index < params.min_tokens:
        banned = [token for token in req.banned_until_min_tokens if allowed(token)]
        num_allowed = int(np.unpackbits(mask.view(np.uint8)).sum())
        if banned and num_allowed > len(banned):
            entries.extend((token, float("-inf")) for token in banned)
    return entries


def _grammar_of(req: Request) -> TokenGrammar:
    assert req.grammar is not None, "a structured table row belongs to a constrained request"
    return req.grammar
