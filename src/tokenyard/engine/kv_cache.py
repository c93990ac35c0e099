"""Paged KV memory: a block pool allocated once, ref-counted blocks, prefix reuse.

A full block is identified by `hash(parent_hash, block_tokens, cache_salt)`: two requests
whose prompts share a prefix of full blocks (and a salt) share those blocks. A freed block
keeps its hash and stays findable until the pool hands it out again, least recently freed
first. A hit is verified against the block's stored tokens, so a hash collision can only
cost a miss, never a wrong answer.

A request may pin prefixes of its prompt (Anthropic's `cache_control` breakpoints): the
cached full blocks covering a pinned prefix stay out of the free queue until their pin's
deadline, which every hit pushes back by the pin's TTL. A pin holds no reference, so
preemption and abort never touch it; at most `max_pinned` blocks are pinned at once (a pin
beyond that is plain LRU), and a request that could not run at all otherwise takes pinned
blocks back (`release_pins`) rather than wait for a deadline.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenyard.engine.request import Request
from tokenyard.wire.block_hash import hash_block, hash_prompt_blocks

__all__ = ["BlockPool", "KVBlock", "KVCacheManager", "hash_block", "hash_prompt_blocks"]


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    tokens: tuple[int, ...] = ()  # stored for hit verification once the block is full


@dataclass
class _Pin:
    deadline: float  # clock seconds
    ttl: float  # seconds; a hit moves the deadline to now + ttl


class BlockPool:
    """All KV blocks, the free queue (LRU order), the hash → block map and the pins."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        *,
        max_pinned: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_pinned`: the most blocks pinned at once (default: half the pool);
        `clock`: seconds, for pin deadlines."""
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the head is the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, KVBlock] = {}
        self.enable_caching = enable_caching
        self.max_pinned = num_blocks // 2 if max_pinned is None else max_pinned
        self._clock = clock
        self._pins: dict[int, _Pin] = {}  # block id → its pin
        # Pinned blocks that no request holds: kept out of the free queue.
        self._pinned_free: OrderedDict[int, None] = OrderedDict()
        self._next_deadline = float("inf")  # no pin expires before this
        #: The KV events since the last `take_events` (`wire/kv_events.py`'s tuples), or
        #: None when nobody publishes them (then nothing is recorded).
        self.events: list[tuple[object, ...]] | None = None
        #: Cached blocks whose hash `allocate` dropped to reuse them, since start.
        self.num_evicted = 0

    def take_events(self) -> list[tuple[object, ...]]:
        """The events recorded since the last call (the step thread's, once a step)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks whose pin has not expired. Read-only, so the stats may call it from
        another thread than the step loop's (expired pins are dropped by the loop)."""
        now = self._clock()
        return sum(1 for pin in list(self._pins.values()) if pin.deadline > now)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests or pins (0..1)."""
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
            self.num_evicted += block.block_hash is not None
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the
        queue; a hit on a pinned block refreshes its pin."""
        now = self._clock()
        for block in blocks:
            pin = self._pins.get(block.block_id)
            if pin is not None:
                pin.deadline = max(pin.deadline, now + pin.ttl)
            if block.ref_cnt == 0:
                if pin is not None:
                    del self._pinned_free[block.block_id]
                else:
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
                if block.block_id in self._pins:
                    self._pinned_free[block.block_id] = None
                elif block.block_hash is None:
                    # Uncached blocks are worthless once free: reuse them first.
                    self._free[block.block_id] = None
                    self._free.move_to_end(block.block_id, last=False)
                else:
                    self._free[block.block_id] = None

    def cache_full_block(self, block: KVBlock, block_hash: bytes, tokens: Sequence[int],
                         parent: bytes | None = None, salt: str | None = None) -> None:
        """Make `block` findable by `block_hash`; `parent` (the previous block's hash)
        and `salt` only describe it in the KV events."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; this copy stays private
        block.block_hash = block_hash
        block.tokens = tuple(tokens)
        self._cached[block_hash] = block
        if self.events is not None:
            self.events.append(("stored", block_hash, parent, salt, block.tokens))

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.append(("removed", block.block_hash))
            block.block_hash = None
            block.tokens = ()

    def reset_prefix_cache(self) -> None:
        self.release_pins(len(self._pins))
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)

    # -- pins ----------------------------------------------------------------------------
    def pin(self, block_hash: bytes, ttl: float) -> bool:
        """Keep the cached block of `block_hash` for `ttl` seconds (a pin already there
        keeps the later deadline and the longer TTL). False when no such block is cached
        or the pin cap is reached: the block then stays plain LRU."""
        block = self._cached.get(block_hash)
        if block is None:
            return False
        deadline = self._clock() + ttl
        pin = self._pins.get(block.block_id)
        if pin is not None:
            pin.deadline, pin.ttl = max(pin.deadline, deadline), max(pin.ttl, ttl)
            return True
        if len(self._pins) >= self.max_pinned:
            self.expire_pins()
            if len(self._pins) >= self.max_pinned:
                return False
        self._pins[block.block_id] = _Pin(deadline, ttl)
        self._next_deadline = min(self._next_deadline, deadline)
        if block.ref_cnt == 0:
            del self._free[block.block_id]
            self._pinned_free[block.block_id] = None
        return True

    def expire_pins(self) -> int:
        """Unpin the blocks whose deadline passed (they go back to LRU as its oldest
        entries: nothing used them for a whole TTL). Returns how many; cheap when none
        is due."""
        if not self._pins:
            return 0
        now = self._clock()
        if now < self._next_deadline:
            return 0
        due = [bid for bid, pin in self._pins.items() if pin.deadline <= now]
        for block_id in due:
            self._unpin(block_id)
        self._next_deadline = min((p.deadline for p in self._pins.values()),
                                  default=float("inf"))
        return len(due)

    def is_pinned(self, block: KVBlock) -> bool:
        return block.block_id in self._pins

    def release_pins(self, n: int, keep: Sequence[KVBlock] = ()) -> int:
        """Unpin up to `n` pinned blocks that no request holds (except those in `keep`),
        soonest deadline first, so a request that cannot run otherwise gets their memory.
        Returns how many."""
        kept = {b.block_id for b in keep}
        order = sorted((bid for bid in self._pinned_free if bid not in kept),
                       key=lambda bid: self._pins[bid].deadline)
        for block_id in order[:n]:
            self._unpin(block_id)
        return min(n, len(order))

    def _unpin(self, block_id: int) -> None:
        del self._pins[block_id]
        if block_id in self._pinned_free:
            del self._pinned_free[block_id]
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)


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
    max_pinned: int | None = None  # default: half the pool
    clock: Callable[[], float] = time.monotonic  # seconds, for pin deadlines
    pool: BlockPool = field(init=False)
    #: Per running request, its blocks. A request keeps one list, which only grows until
    #: `free` drops it: the runner's persistent batch copies only the new blocks.
    block_tables: dict[str, list[KVBlock]] = field(default_factory=dict)
    _hashes: dict[str, list[bytes]] = field(default_factory=dict)
    _num_registered: dict[str, int] = field(default_factory=dict)  # blocks already offered
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, self.enable_caching,
                              max_pinned=self.max_pinned, clock=self.clock)

    @property
    def num_pinned_blocks(self) -> int:
        return self.pool.num_pinned_blocks

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
        self,
        request: Request,
        num_new_tokens: int,
        cached: Sequence[KVBlock] = (),
        *,
        unpin: bool = False,
        computed: int | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` after the computed ones; False if the pool is short.

        `cached` are prefix-hit blocks for a request being scheduled for the first time (its
        `num_computed_tokens` already counts them). `unpin`: the request cannot run
        otherwise (nothing else holds blocks), so pinned blocks give way if short.
        `computed`: the tokens already computed in this pool, where it is not the
        request's own count (a draft model's pool, spec/draft.py).
        """
        self.pool.expire_pins()
        table = self.block_tables.get(request.request_id, [])
        if computed is None:
            computed = request.num_computed_tokens
        total = computed + num_new_tokens
        if table and not cached and total <= len(table) * self.block_size and (
                not self.enable_caching
                or total // self.block_size <= self._num_registered.get(request.request_id, 0)):
            return True  # a decode inside its last block: no block to take or register
        need = self.blocks_needed(total) - len(table) - len(cached)
        short = need - self._num_free_for(cached)
        if short > 0 and unpin:
            self.pool.release_pins(short, keep=cached)
            short = need - self._num_free_for(cached)
        if short > 0:
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

    def _num_free_for(self, cached: Sequence[KVBlock]) -> int:
        """Free blocks left once the hits in `cached` are taken out of the free queue."""
        taken = sum(1 for b in cached if b.ref_cnt == 0 and not self.pool.is_pinned(b))
        return self.pool.num_free_blocks - taken

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
                self.pool.cache_full_block(block, hashes[i], tokens[i * bs:(i + 1) * bs],
                                           hashes[i - 1] if i else None, request.cache_salt)
            ttl = self._pin_ttl(request, i)
            if ttl is not None:
                # By hash: a private copy of an already cached block pins the cached one.
                self.pool.pin(hashes[i], ttl)
        self._num_registered[request.request_id] = max(start, end)

    def _pin_ttl(self, request: Request, block_index: int) -> float | None:
        """The longest TTL of the request's pins that cover the whole block, or None."""
        end = (block_index + 1) * self.block_size
        return max((ttl for num_tokens, ttl in request.pins if num_tokens >= end),
                   default=None)
