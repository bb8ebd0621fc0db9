"""The paged KV cache's bookkeeping: which blocks are free, which belong to whom."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from cbpipe.scheduler.request import Request


class OutOfBlocksError(RuntimeError):
    pass


class BlockManager:
    """A free list of fixed-size KV blocks. The tensors themselves live in the worker."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, block_ids: list[int], num_tokens: int) -> int:
        """Blocks to add to a table of ``block_ids`` so it holds ``num_tokens`` tokens."""
        return max(self.blocks_for(num_tokens) - len(block_ids), 0)

    def grow(self, block_ids: list[int], num_tokens: int) -> None:
        """Append free blocks to ``block_ids`` until it holds ``num_tokens`` tokens."""
        missing = self.num_missing_blocks(block_ids, num_tokens)
        if missing > len(self._free):
            raise OutOfBlocksError(f"need {missing} blocks, {len(self._free)} free")
        block_ids.extend(self._free.popleft() for _ in range(missing))

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)
        block_ids.clear()


class BlockTables:
    """Every running request's block ids as one row of a numpy matrix.

    The packer copies a step's block tables out of it with one fancy-indexed assignment
    instead of one numpy call per sequence (at 256 sequences of 72 blocks, that loop was a
    third of the scheduler's time per step). A row changes only when its request gains a
    block, about once every ``block_size`` decode steps.
    """

    def __init__(self, num_rows: int, initial_width: int = 64) -> None:
        self.rows = np.zeros((num_rows, initial_width), dtype=np.int32)
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._written = [0] * num_rows  # ids in each row that match its request's table

    def assign(self, req: Request) -> None:
        if not self._free_rows:
            raise RuntimeError("more running requests than block-table rows")
        req.table_row = row = self._free_rows.pop()
        self._written[row] = 0
        self.sync(req)

    def release(self, req: Request) -> None:
        if req.table_row is not None:
            self._free_rows.append(req.table_row)
            req.table_row = None

    def sync(self, req: Request) -> None:
        """Copy the blocks ``req`` gained since the last call into its row."""
        row, ids = req.table_row, req.block_ids
        assert row is not None
        start = self._written[row]
        if start == len(ids):
            return
        if len(ids) > self.rows.shape[1]:
            wider = np.zeros((self.rows.shape[0], max(len(ids), 2 * self.rows.shape[1])), np.int32)
            wider[:, : self.rows.shape[1]] = self.rows
            self.rows = wider
        self.rows[row, start : len(ids)] = ids[start:]
        self._written[row] = len(ids)
