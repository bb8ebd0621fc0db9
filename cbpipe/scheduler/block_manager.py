"""The paged KV cache's bookkeeping: which blocks are free, which belong to whom."""

from __future__ import annotations

from collections import deque


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
