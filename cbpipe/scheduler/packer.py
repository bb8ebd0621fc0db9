"""Writes a ``StepPlan`` into a slot's input arrays and reads sampled ids back."""

from __future__ import annotations

import numpy as np

from cbpipe.protocol.messages import Step
from cbpipe.protocol.slots import SlotLayout, numpy_views
from cbpipe.scheduler.core import StepPlan


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
        limits = self.layout.limits
        num_seqs = len(plan.seqs)
        num_tokens = plan.num_tokens
        if num_seqs > limits.max_seqs or num_tokens > limits.max_tokens:
            raise ValueError(f"step {plan.step} exceeds the slot's capacity")
        width = max(len(s.req.block_ids) for s in plan.seqs)
        tables = views["block_tables"][: num_seqs * width].reshape(num_seqs, width)
        tables.fill(0)  # padding entries are never read: context_lens bounds every sequence

        query_start = views["query_start"]
        query_start[0] = 0
        row = 0
        for index, seq in enumerate(plan.seqs):
            req = seq.req
            end = row + seq.num_query_tokens
            positions = np.arange(seq.start, seq.start + seq.num_query_tokens)
            views["positions"][row:end] = positions
            blocks = np.asarray(req.block_ids, dtype=np.int64)
            views["slot_mapping"][row:end] = (
                blocks[positions // self.block_size] * self.block_size + positions % self.block_size
            )
            views["token_seq"][row:end] = index
            views["carry_mask"][row:end] = False
            views["carry_src"][row:end] = 0  # a valid index even where unused
            if seq.carry_src is not None:
                views["carry_mask"][row] = True
                views["carry_src"][row] = seq.carry_src
                views["input_ids"][row] = 0  # ignored: the device takes the carried token
            else:
                views["input_ids"][row:end] = req.known_tokens(seq.start, seq.start + (end - row))
            query_start[index + 1] = end
            views["context_lens"][index] = seq.start + seq.num_query_tokens
            tables[index, : len(blocks)] = blocks
            params = req.params
            views["temperature"][index] = params.temperature
            views["top_p"][index] = params.top_p
            views["top_k"][index] = params.top_k
            views["seed"][index] = req.seed
            views["output_index"][index] = seq.output_index
            row = end

        views["header"][:] = (plan.step, num_tokens, num_seqs)
        sampling = [s.req.params for s in plan.seqs]
        carries = any(s.carry_src is not None for s in plan.seqs)
        if carries and previous_slot is None:
            raise ValueError(f"step {plan.step} carries tokens over but no step came before it")
        return Step(
            step=plan.step,
            slot=slot,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            num_single_token_seqs=plan.num_single_token_seqs,
            max_query_len=max(s.num_query_tokens for s in plan.seqs),
            max_context_len=int(views["context_lens"][:num_seqs].max()),
            block_table_width=width,
            carry_from_slot=previous_slot if carries else None,
            all_greedy=all(p.is_greedy for p in sampling),
            needs_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in sampling),
        )

    def sampled_ids(self, slot: int, num_seqs: int) -> np.ndarray:
        return self._views[slot]["sampled_ids"][:num_seqs].copy()
