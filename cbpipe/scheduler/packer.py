"""Writes a ``StepPlan`` into a slot's input arrays and reads sampled ids back.

This runs once per step on the scheduler's critical path, so per-sequence work is plain
Python list building, and each field is written with one numpy assignment; only prefill
chunks (a few per step, many rows each) are written slice by slice.
"""

from __future__ import annotations

import numpy as np

from cbpipe.protocol.messages import Step
from cbpipe.protocol.slots import SlotLayout, numpy_views
from cbpipe.scheduler.core import ScheduledSeq, StepPlan


class BatchPacker:
    """Packs plans into the slots of one shared-memory segment (numpy views, no copies kept)."""

    def __init__(self, buffer: memoryview, layout: SlotLayout, block_size: int) -> None:
        self.layout = layout
        self.block_size = block_size
        self._views = [numpy_views(buffer, layout, slot) for slot in range(layout.num_slots)]

    def pack(self, plan: StepPlan, slot: int, previous_slot: int | None) -> Step:
        """Fill ``slot`` with ``plan`` and return the message that hands it to the worker.

        ``previous_slot`` holds the step sent just before this one; rows that carry a token
        over read that slot's sampled ids on the device.
        """
        views = self._views[slot]
        seqs = plan.seqs
        num_seqs, num_tokens = len(seqs), plan.num_tokens
        limits = self.layout.limits
        if num_seqs > limits.max_seqs or num_tokens > limits.max_tokens:
            raise ValueError(f"step {plan.step} exceeds the slot's capacity")
        carries = any(s.carry_src is not None for s in seqs)
        if carries and previous_slot is None:
            raise ValueError(f"step {plan.step} carries tokens over but no step came before it")

        num_decodes = plan.num_single_token_seqs
        self._pack_decode_rows(views, seqs[:num_decodes])
        row = num_decodes
        for index in range(num_decodes, num_seqs):
            row = self._pack_chunk_rows(views, seqs[index], index, row)
        width = self._pack_sequences(views, seqs, plan.block_tables)

        views["header"][:] = (plan.step, num_tokens, num_seqs, width)
        params = [s.req.params for s in seqs]
        return Step(
            step=plan.step,
            slot=slot,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            num_single_token_seqs=num_decodes,
            max_query_len=max(s.num_query_tokens for s in seqs),
            max_context_len=max(s.start + s.num_query_tokens for s in seqs),
            block_table_width=width,
            carry_from_slot=previous_slot if carries else None,
            all_greedy=all(p.is_greedy for p in params),
            needs_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        )

    def sampled_ids(self, slot: int, num_seqs: int) -> np.ndarray:
        return self._views[slot]["sampled_ids"][:num_seqs].copy()

    def _pack_decode_rows(self, views: dict[str, np.ndarray], seqs: list[ScheduledSeq]) -> None:
        """Rows of one token, seq i on row i: one list per field, one assignment each."""
        n = len(seqs)
        bs = self.block_size
        positions = [s.start for s in seqs]
        views["positions"][:n] = positions
        views["slot_mapping"][:n] = [
            s.req.block_ids[p // bs] * bs + p % bs for s, p in zip(seqs, positions, strict=True)
        ]
        views["token_seq"][:n] = np.arange(n)
        views["carry_mask"][:n] = [s.carry_src is not None for s in seqs]
        views["carry_src"][:n] = [s.carry_src or 0 for s in seqs]  # 0: a valid unused index
        # A carried row's id is ignored: the device takes the previous step's sampled id.
        views["input_ids"][:n] = [0 if s.carry_src is not None else s.req.token_at(s.start)
                                  for s in seqs]  # fmt: skip

    def _pack_chunk_rows(
        self, views: dict[str, np.ndarray], seq: ScheduledSeq, index: int, row: int
    ) -> int:
        """A prefill chunk's rows, which start at ``row``; returns the row after them."""
        end = row + seq.num_query_tokens
        positions = np.arange(seq.start, seq.start + seq.num_query_tokens)
        blocks = np.asarray(seq.req.block_ids, dtype=np.int64)
        views["positions"][row:end] = positions
        views["slot_mapping"][row:end] = (
            blocks[positions // self.block_size] * self.block_size + positions % self.block_size
        )
        views["token_seq"][row:end] = index
        views["carry_mask"][row:end] = False
        views["carry_src"][row:end] = 0
        views["input_ids"][row:end] = seq.req.known_tokens(seq.start, seq.start + (end - row))
        return end

    def _pack_sequences(
        self, views: dict[str, np.ndarray], seqs: list[ScheduledSeq], block_tables: np.ndarray
    ) -> int:
        """Per-sequence fields and block tables; returns the block-table row width."""
        n = len(seqs)
        lengths = [s.num_query_tokens for s in seqs]
        views["query_start"][0] = 0
        views["query_start"][1 : n + 1] = np.cumsum(lengths)
        views["context_lens"][:n] = [s.start + s.num_query_tokens for s in seqs]
        views["output_index"][:n] = [s.output_index for s in seqs]
        views["seed"][:n] = [s.req.seed for s in seqs]
        params = [s.req.params for s in seqs]
        views["temperature"][:n] = [p.temperature for p in params]
        views["top_p"][:n] = [p.top_p for p in params]
        views["top_k"][:n] = [p.top_k for p in params]
        width = max(len(s.req.block_ids) for s in seqs)
        rows = np.fromiter((s.req.table_row for s in seqs), dtype=np.intp, count=n)
        # Columns past a sequence's own blocks hold stale ids; context_lens keeps them unread.
        views["block_tables"][: n * width].reshape(n, width)[:] = block_tables[rows, :width]
        return width
