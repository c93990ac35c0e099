"""Prefix affinity: which replica served a prompt prefix recently.

A prompt's *block hashes* chain its tokens block by block (the engine's block size), salted
with the tenant's cache salt, so equal hashes mean an equal prefix of the same tenant —
exactly what the replica's prefix cache can reuse. The balancer sends a prompt to the
replica that holds its longest prefix; this table is its memory of who holds what: a
bounded LRU in process, or in Redis (`gateway/redis_affinity.py`) when several gateways
share it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

#: Leading blocks hashed at most: long prompts route on their first ~4k tokens.
MAX_BLOCKS = 256


def prefix_hashes(tokens: Sequence[int], block_size: int, salt: str | None = None,
                  max_blocks: int = MAX_BLOCKS) -> list[int]:
    """One 63-bit hash per full block of `tokens`, each over every token before it."""
    out: list[int] = []
    h = hashlib.blake2b(digest_size=8, key=(salt or "").encode()[:64])
    for start in range(0, min(len(tokens) // block_size, max_blocks) * block_size,
                       block_size):
        h.update(",".join(map(str, tokens[start:start + block_size])).encode() + b";")
        out.append(int.from_bytes(h.copy().digest(), "little") >> 1)
    return out


class AffinityTable(Protocol):
    """Prefix block hash → the replica that served it most recently."""

    async def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each replica, how many leading `hashes` it served last (0s omitted)."""
        ...

    async def record(self, hashes: Sequence[int], replica: str) -> None:
        """`replica` now holds every prefix in `hashes`."""
        ...

    async def close(self) -> None:
        """Release its connections (if any)."""
        ...


class LocalAffinity:
    """The in-process table: a bounded LRU over block hashes."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._owner: OrderedDict[int, str] = OrderedDict()

    async def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        return self.lookup_now(hashes)

    def lookup_now(self, hashes: Sequence[int]) -> dict[str, int]:
        depth: dict[str, int] = {}
        owner = self._owner
        for i, h in enumerate(hashes):
            replica = owner.get(h)
            if replica is None:
                break
            depth[replica] = i + 1
        return depth

    async def record(self, hashes: Sequence[int], replica: str) -> None:
        owner = self._owner
        for h in hashes:
            owner[h] = replica
            owner.move_to_end(h)
        while len(owner) > self.max_entries:
            owner.popitem(last=False)

    async def close(self) -> None:
        return None

    def forget(self, replica: str) -> None:
        """Drop what `replica` held (it restarted empty, or left the pool)."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]

    def __len__(self) -> int:
        return len(self._owner)
