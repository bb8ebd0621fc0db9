"""The paged KV cache's bookkeeping: which blocks are free, whose they are, which are cached.

With prefix caching, a full block whose tokens are known is *published* under a hash chained
over its parent block's hash and its own tokens (and the request's cache salt), and stays
findable after the requests that hold it are done: a later request whose prompt starts with
the same tokens takes those blocks instead of computing them again. Blocks are reference
counted; one that no request holds but that is cached is *evictable*: it counts as free, and
is given out (its hash forgotten) only when no uncached free block is left, least recently
used first. Every operation touches only the blocks it names: none scans the cache.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from cbpipe.scheduler.block_hashes import BlockHash

if TYPE_CHECKING:
    from cbpipe.scheduler.request import Request


class OutOfBlocksError(RuntimeError):
    pass


class BlockManager:
    """Fixed-size KV blocks: a free list, reference counts and, with ``prefix_caching``, the
    cache of published blocks. The tensors themselves live in the worker."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # held by nobody, cached by nobody
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, BlockHash] = {}  # published blocks
        self._block_of: dict[BlockHash, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld; oldest first
        # Prompt tokens looked up in the cache, and those found, since start (in tokens).
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request may take: the free ones and the evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, block_ids: list[int], num_tokens: int) -> int:
        """Blocks to add to a table of ``block_ids`` so it holds ``num_tokens`` tokens."""
        return max(self.blocks_for(num_tokens) - len(block_ids), 0)

    def grow(self, block_ids: list[int], num_tokens: int) -> None:
        """Append blocks to ``block_ids`` until it holds ``num_tokens`` tokens: free ones
        first, then the least recently used cached ones, which stop being cached."""
        if not self.try_grow(block_ids, num_tokens):
            missing = self.num_missing_blocks(block_ids, num_tokens)
            raise OutOfBlocksError(f"need {missing} blocks, {self.num_free_blocks} free")

    def try_grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """``grow``, or False and nothing taken where too few blocks are free."""
        missing = self.blocks_for(num_tokens) - len(block_ids)
        if missing > self.num_free_blocks:
            return False
        for _ in range(missing):
            block_ids.append(self._take_free())
        return True

    def free(self, block_ids: list[int]) -> None:
        """Release a table's blocks: uncached ones go back to the free list, cached ones stay
        findable until they are needed (newest last, so the oldest go first)."""
        for block in reversed(block_ids):  # a table's tail is its least shared part
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        block_ids.clear()

    # --- prefix caching -------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (none are taken yet)."""
        found = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def num_evictable(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` count as free now (cached, held by nobody)."""
        return sum(1 for block in block_ids if self._refs[block] == 0)

    def take(self, block_ids: list[int]) -> None:
        """Hold cached blocks found by ``match`` for a new table."""
        for block in block_ids:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def publish(self, block: int, block_hash: BlockHash) -> None:
        """Make a full block findable. The step that writes it has been planned (and is sent
        before any step a later plan makes), and steps run in order on the device, so whoever
        finds it reads it after it is written; a step that both writes and reads it writes
        every layer's keys before that layer attends. A hash already published keeps its
        first block: the copy stays this table's, uncached."""
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count a request's prompt tokens as looked up in the cache, ``num_hit_tokens`` of
        them found; nothing is looked up with caching off."""
        if not self.prefix_caching:
            return
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def check(self, tables: Iterable[list[int]]) -> None:
        """Raise ``AssertionError`` unless the bookkeeping agrees with the tables that hold
        blocks: every block free, evictable or held, held exactly by the tables naming it."""
        held = [0] * self.num_blocks
        for table in tables:
            for block in table:
                held[block] += 1
        assert held == self._refs, "reference counts disagree with the block tables"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is twice on the free list"
        assert not free & evictable, "a block is both free and cached"
        for block in range(self.num_blocks):
            kinds = (block in free, block in evictable, held[block] > 0)
            assert sum(kinds) == 1, f"block {block} is free/evictable/held: {kinds}"
            assert (block in evictable) <= (block in self._hash_of), f"block {block} uncached"
        assert all(self._block_of[h] == b for b, h in self._hash_of.items()), "hash map broken"
        assert len(self._block_of) == len(self._hash_of), "hash map broken"

    def _take_free(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block


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
        if start + 1 == len(ids):  # a decode's new block: a scalar store, not a slice's
            self.rows[row, start] = ids[start]
        else:
            self.rows[row, start : len(ids)] = ids[start:]
        self._written[row] = len(ids)
