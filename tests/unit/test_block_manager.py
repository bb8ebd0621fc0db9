import pytest

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
