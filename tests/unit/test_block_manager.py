import hashlib
import sys

import pytest

from cbpipe.scheduler.block_hashes import chain_hash, chain_hashes
from cbpipe.scheduler.block_manager import BlockManager, OutOfBlocksError


def test_grow_takes_only_missing_blocks_and_free_returns_them() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    table: list[int] = []
    blocks.grow(table, 5)  # 5 tokens need 2 blocks
    assert len(table) == 2 and blocks.num_free_blocks == 6
    blocks.grow(table, 8)  # still 2 blocks
    assert len(table) == 2
    blocks.grow(table, 9)
    assert len(table) == 3 and len(set(table)) == 3
    blocks.free(table)
    assert table == [] and blocks.num_free_blocks == 8


def test_grow_refuses_without_taking_anything() -> None:
    blocks = BlockManager(num_blocks=2, block_size=4)
    table: list[int] = []
    with pytest.raises(OutOfBlocksError):
        blocks.grow(table, 9)
    assert table == [] and blocks.num_free_blocks == 2


def test_try_grow_takes_cached_blocks_last_and_refuses_without_taking_anything() -> None:
    blocks = BlockManager(num_blocks=3, block_size=2, prefix_caching=True)
    table, _ = published(blocks, 2, tag=1)
    (cached,) = table
    blocks.free(table)  # evictable: counts as free, given out last
    assert blocks.try_grow(table, 4) and cached not in table
    assert not blocks.try_grow(table, 8)  # 2 more blocks, 1 left
    assert len(table) == 2 and blocks.num_free_blocks == 1 and blocks.num_cached_blocks == 1
    assert blocks.try_grow(table, 6) and table[-1] == cached
    assert blocks.num_cached_blocks == 0
    blocks.check([table])


def test_tables_never_share_blocks() -> None:
    blocks = BlockManager(num_blocks=6, block_size=2)
    a: list[int] = []
    b: list[int] = []
    blocks.grow(a, 5)
    blocks.grow(b, 6)
    assert not set(a) & set(b)
    assert blocks.num_missing_blocks(a, 7) == 1
    blocks.free(a)
    blocks.grow(b, 12)
    assert len(set(b)) == 6


def test_block_hashes_chain_over_parents_tokens_and_salt() -> None:
    first = chain_hash(None, [1, 2, 3, 4], None)
    assert first == chain_hash(None, [1, 2, 3, 4], None)
    assert first != chain_hash(None, [1, 2, 3, 5], None)
    assert first != chain_hash(None, [1, 2, 3, 4], "tenant-a")
    second = chain_hash(first, [5, 6, 7, 8], None)
    # The same tokens after another block are another block.
    assert second != chain_hash(chain_hash(None, [9, 9, 9, 9], None), [5, 6, 7, 8], None)


def test_a_prompt_hashed_whole_chains_as_its_blocks_hashed_one_at_a_time() -> None:
    """A prompt's blocks are hashed in one call, a decode's one block at a time: both must
    name a block alike, or a cached reply would never be found."""
    tokens = [7, 1 << 40, 0, 3, 128_255, 9, 2, 5, 11]  # two full blocks of 4 and a partial one
    whole = chain_hashes(None, tokens, 4, "salt")
    first = chain_hash(None, tokens[:4], "salt")
    assert whole == [first, chain_hash(first, tokens[4:8], "salt")]
    # What a hash covers: the parent's hash as the key, the tokens as 64-bit integers.
    data = b"".join(t.to_bytes(8, sys.byteorder, signed=True) for t in tokens[4:8])
    assert whole[1] == hashlib.blake2b(data, digest_size=16, key=first).digest()


def published(blocks: BlockManager, num_tokens: int, tag: int) -> tuple[list[int], list[bytes]]:
    """A table of ``num_tokens`` whose full blocks are published under tag-derived hashes."""
    table: list[int] = []
    blocks.grow(table, num_tokens)
    hashes = [chain_hash(None, [tag, i], None) for i in range(num_tokens // blocks.block_size)]
    for block, block_hash in zip(table, hashes, strict=False):
        blocks.publish(block, block_hash)
    return table, hashes


def test_freed_cached_blocks_stay_findable_and_count_as_free() -> None:
    blocks = BlockManager(num_blocks=6, block_size=4, prefix_caching=True)
    table, hashes = published(blocks, 10, tag=1)  # 3 blocks, 2 full and published
    blocks.free(table)
    assert blocks.num_free_blocks == 6 and blocks.num_cached_blocks == 2
    found = blocks.match(hashes + [chain_hash(None, [0], None)])
    assert len(found) == 2 and blocks.num_evictable(found) == 2
    blocks.take(found)
    assert blocks.num_free_blocks == 4
    blocks.check([found])
    blocks.free(found)
    blocks.check([])


def test_cached_blocks_are_evicted_only_when_nothing_else_is_free_oldest_first() -> None:
    blocks = BlockManager(num_blocks=4, block_size=2, prefix_caching=True)
    old, old_hashes = published(blocks, 2, tag=1)
    new, new_hashes = published(blocks, 2, tag=2)
    blocks.free(old)  # freed first: least recently used
    blocks.free(new)
    table: list[int] = []
    blocks.grow(table, 4)  # the two uncached free blocks
    assert blocks.match(old_hashes) and blocks.match(new_hashes)
    blocks.grow(table, 6)  # one more: the oldest cached block goes
    assert not blocks.match(old_hashes) and blocks.match(new_hashes)
    blocks.check([table])


def test_a_hash_published_twice_keeps_its_first_block() -> None:
    blocks = BlockManager(num_blocks=4, block_size=2, prefix_caching=True)
    a, hashes = published(blocks, 2, tag=1)
    b, _ = published(blocks, 2, tag=1)  # computed twice in one step
    assert blocks.match(hashes) == a
    blocks.free(b)  # the copy was never cached: back on the free list
    blocks.free(a)
    blocks.check([])
    assert blocks.num_cached_blocks == 1


def test_check_catches_a_table_that_disagrees() -> None:
    blocks = BlockManager(num_blocks=4, block_size=2, prefix_caching=True)
    table: list[int] = []
    blocks.grow(table, 4)
    with pytest.raises(AssertionError, match="reference counts"):
        blocks.check([table, table[:1]])
