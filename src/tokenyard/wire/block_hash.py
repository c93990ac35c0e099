"""The prefix-cache block hash, shared by the engine and the balancer.

A full block of `block_size` tokens is named by `hash(parent_hash, block_tokens,
cache_salt)`: two prompts of one tenant (salt) that share a prefix of full blocks share
those hashes. The engine keys its cached blocks by them and publishes them in its KV
events (`wire/kv_events.py`); the balancer hashes a prompt with the same function to ask
its index which replica holds the longest prefix. One module, so the two cannot drift.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def hash_block(parent: bytes | None, tokens: Sequence[int], salt: str | None) -> bytes:
    """Stable 16-byte hash of one full block, chained to its parent's hash."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    if salt:
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()


def hash_prompt_blocks(tokens: Sequence[int], block_size: int, salt: str | None,
                       max_blocks: int | None = None) -> list[bytes]:
    """Hash chain of every full block in `tokens` (the first `max_blocks` at most)."""
    hashes: list[bytes] = []
    parent: bytes | None = None
    n = len(tokens) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    for start in range(0, n * block_size, block_size):
        parent = hash_block(parent, tokens[start:start + block_size], salt)
        hashes.append(parent)
    return hashes


def block_key(block_hash: bytes) -> int:
    """A block hash as the balancer's 63-bit integer key (its first 8 bytes)."""
    return int.from_bytes(block_hash[:8], "little") >> 1


def salt_hash(salt: str | None) -> bytes | None:
    """What the KV events say of a block's tenant: a hash of its salt, never the salt."""
    if not salt:
        return None
    return hashlib.blake2b(salt.encode(), digest_size=8, person=b"kv-salt").digest()
