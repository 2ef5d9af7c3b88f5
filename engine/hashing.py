"""The one block-hash function H of DESIGN.md §3, shared by the engine and the router.

    hash_i = H(hash_{i-1}, token_ids of block i, extra keys)

Stable across processes, machines and Python versions: BLAKE2b over a fixed little-endian
encoding, never Python's ``hash()``. Hashes are 16-byte ``bytes`` (hashable, msgpack-native).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

HASH_ALGORITHM = "blake2b-128-v1"
# The root's parent: a per-model salt could go here; the empty digest keeps it simple.
ROOT_PARENT: BlockHash = b"\x00" * 16


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str | int] = ()
) -> BlockHash:
    """Hash one full block, chained to its parent's hash (None for the first block)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else ROOT_PARENT)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    for key in extra_keys:
        data = key.encode() if isinstance(key, str) else struct.pack("<q", key)
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return h.digest()


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str | int] = (),
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``token_ids``; a trailing partial one is skipped."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
