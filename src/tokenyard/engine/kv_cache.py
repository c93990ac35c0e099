"""Paged KV memory: a block pool allocated once, ref-counted blocks, prefix reuse.

A full block is identified by `hash(parent_hash, block_tokens, cache_salt)`: two requests
whose prompts share a prefix of full blocks (and a salt) share those blocks. A freed block
keeps its hash and stays findable until the pool hands it out again, least recently freed
first. A hit is verified against the block's stored tokens, so a hash collision can only
cost a miss, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenyard.engine.request import Request


def hash_block(parent: bytes | None, tokens: Sequence[int], salt: str | None) -> bytes:
    """Stable 16-byte hash of one full block, chained to its parent's hash."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    if salt:
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()


def hash_prompt_blocks(tokens: Sequence[int], block_size: int, salt: str | None) -> list[bytes]:
    """Hash chain of every full block in `tokens`."""
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start:start + block_size], salt)
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    tokens: tuple[int, ...] = ()  # stored for hit verification once the block is full


class BlockPool:
    """All KV blocks, the free queue (LRU order) and the hash → block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the head is the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, KVBlock] = {}
        self.enable_caching = enable_caching

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (0..1)."""
        return 1.0 - len(self._free) / len(self.blocks)

    def lookup(self, block_hash: bytes, tokens: Sequence[int]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.tokens != tuple(tokens):
            return None
        return block

    def allocate(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the head of the free queue, evicting their cached hashes."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop a reference on each block; blocks reaching zero join the free queue's tail.

        Callers pass a sequence's blocks tail first, so a sequence's last blocks are evicted
        before its first ones (the first are the most shareable).
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Uncached blocks are worthless once free: reuse them first.
                    self._free[block.block_id] = None
                    self._free.move_to_end(block.block_id, last=False)
                else:
                    self._free[block.block_id] = None

    def cache_full_block(self, block: KVBlock, block_hash: bytes, tokens: Sequence[int]) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; this copy stays private
        block.block_hash = block_hash
        block.tokens = tuple(tokens)
        self._cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.tokens = ()

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)


@dataclass
class CacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found in the cache


@dataclass
class KVCacheManager:
    """Block tables of the running requests, over one BlockPool."""

    num_blocks: int
    block_size: int = 16
    enable_caching: bool = True
    pool: BlockPool = field(init=False)
    block_tables: dict[str, list[KVBlock]] = field(default_factory=dict)
    _hashes: dict[str, list[bytes]] = field(default_factory=dict)
    _num_registered: dict[str, int] = field(default_factory=dict)  # blocks already offered
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, self.enable_caching)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Longest run of cached full blocks that prefixes the request's tokens.

        At least one token is always left to compute, so the step has logits to sample.
        """
        if not self.enable_caching:
            return []
        tokens = request.all_token_ids
        hashes = self._block_hashes(request)
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(hashes[:max_blocks]):
            start = i * self.block_size
            block = self.pool.lookup(block_hash, tokens[start:start + self.block_size])
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached: Sequence[KVBlock] = ()
    ) -> bool:
        """Make room for `num_new_tokens` after the computed ones; False if the pool is short.

        `cached` are prefix-hit blocks for a request being scheduled for the first time (its
        `num_computed_tokens` already counts them).
        """
        table = self.block_tables.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(total) - len(table) - len(cached)
        reclaimable = sum(1 for b in cached if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaimable:
            return False
        self.pool.touch(cached)
        table = self.block_tables.setdefault(request.request_id, table)
        table.extend(cached)
        if need > 0:
            table.extend(self.pool.allocate(need))
        self._cache_full_blocks(request, table, total)
        return True

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, [])
        self.pool.free(table[::-1])
        self._hashes.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request_id, [])]

    def _block_hashes(self, request: Request) -> list[bytes]:
        """The request's hash chain, extended as its token list grows (never recomputed)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[start:start + bs], request.cache_salt))
        return hashes

    def _cache_full_blocks(self, request: Request, table: list[KVBlock], num_tokens: int) -> None:
        """Register blocks that will be full once `num_tokens` are computed."""
        if not self.enable_caching:
            return
        hashes = self._block_hashes(request)
        tokens = request.all_token_ids
        bs = self.block_size
        start = self._num_registered.get(request.request_id, 0)
        end = min(num_tokens // bs, len(hashes))
        for i in range(start, end):
            block = table[i]
            if block.block_hash is None:
                self.pool.cache_full_block(block, hashes[i], tokens[i * bs:(i + 1) * bs])
        self._num_registered[request.request_id] = max(start, end)
