"""The identities of full KV blocks for prefix caching: a hash chained over the block before
it and its own tokens, the first keyed by the request's cache salt. Requests compute them as
their tokens become known; the block manager finds and publishes blocks by them."""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence

BlockHash = bytes


def chain_hashes(
    parent: BlockHash | None, token_ids: Sequence[int], block_size: int, salt: str | None
) -> list[BlockHash]:
    """The identities of the full blocks of ``token_ids``, which follow the block hashed
    ``parent`` (None: they start the sequence). A block's hash covers its tokens and the
    block before it (so equal blocks at different places differ) and, for the first block,
    the request's cache salt. BLAKE2b, not Python's ``hash``: a collision would hand one
    request another's keys and values, and tuples of ints hash predictably."""
    pack = _block_packer(block_size)
    key = parent if parent is not None else _salt_key(salt)
    hashes = []
    blake2b = hashlib.blake2b
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        data = pack(*token_ids[start : start + block_size])
        key = blake2b(data, digest_size=16, key=key).digest()
        hashes.append(key)
    return hashes


@functools.cache
def _block_packer(block_size: int) -> Callable[..., bytes]:
    """A block's token ids as the bytes its hash covers: native 64-bit integers, one after
    another. One ``struct`` call a block; an ``array`` and a view of it cost three times as
    much, and a decode that fills a block hashes just that one."""
    return struct.Struct(f"={block_size}q").pack


def _salt_key(salt: str | None) -> bytes:
    """The key the first block is hashed with: the parent it does not have."""
    return hashlib.blake2b(b"cbpipe-salt:" + (salt or "").encode(), digest_size=16).digest()


def chain_hash(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None) -> BlockHash:
    """The identity of one full block (``chain_hashes`` of its tokens)."""
    (block_hash,) = chain_hashes(parent, token_ids, len(token_ids), salt)
    return block_hash
