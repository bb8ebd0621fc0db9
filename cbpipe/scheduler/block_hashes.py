"""The identities of full KV blocks for prefix caching: a hash chained over the block before
it and its own tokens, the first keyed by the request's cache salt. Requests compute them as
their tokens become known; the block manager finds and publishes blocks by them."""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence

BlockHash = bytes


def chain_hashes(
    parent: BlockHash | None, token_ids: Sequence[int], block_size: int, salt: str | None
) -> list[BlockHash]:
    """The identities of the full blocks of ``token_ids``, which follow the block hashed
    ``parent`` (None: they start the sequence). A block's hash covers its tokens and the
    block before it (so equal blocks at different places differ) and, for the first block,
    the request's cache salt. BLAKE2b, not Python's ``hash``: a collision would hand one
    request another's keys and values, and tuples of ints hash predictably."""
    data = memoryview(array.array("q", token_ids)).cast("B")
    step = block_size * 8
    key = parent if parent is not None else _salt_key(salt)
    hashes = []
    blake2b = hashlib.blake2b
    for start in range(0, len(token_ids) // block_size * step, step):
        key = blake2b(data[start : start + step], digest_size=16, key=key).digest()
        hashes.append(key)
    return hashes


def _salt_key(salt: str | None) -> bytes:
    """The key the first block is hashed with: the parent it does not have."""
    return hashlib.blake2b(b"cbpipe-salt:" + (salt or "").encode(), digest_size=16).digest()


def chain_hash(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None) -> BlockHash:
    """The identity of one full block (``chain_hashes`` of its tokens)."""
    (block_hash,) = chain_hashes(parent, token_ids, len(token_ids), salt)
    return block_hash
