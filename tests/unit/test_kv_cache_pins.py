"""Prompt-cache pins (Anthropic's cache_control) in the KV pool: pinned prefix blocks
survive LRU eviction for their TTL, hits refresh it, a cap bounds them, and neither
preemption nor abort leaks a block."""

from __future__ import annotations

from tokenyard.engine.kv_cache import KVCacheManager
from tokenyard.engine.request import Request
from tokenyard.engine.scheduler import Scheduler
from tokenyard.wire.protocol import GenerateRequest, cache_writes
from tokenyard.wire.replica_info import stats_from_json
from tokenyard.wire.sampling_params import SamplingParams

BS = 4


class Clock:
    """A settable clock (seconds) for pin deadlines."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_request(rid: str, tokens: list[int], pins: tuple[tuple[int, float], ...] = (),
                 max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), pins=pins)


def run(kv: KVCacheManager, rid: str, tokens: list[int],
        pins: tuple[tuple[int, float], ...] = ()) -> int:
    """Admit a request as the scheduler does (prefix hit, then allocation), compute its
    prompt, free it; returns its cached-token count."""
    request = make_request(rid, tokens, pins)
    hits = kv.find_cached_prefix(request)
    request.num_computed_tokens = len(hits) * BS
    assert kv.allocate_slots(request, len(tokens) - request.num_computed_tokens, hits)
    kv.free(request)
    return len(hits) * BS


def flood(kv: KVCacheManager, n: int, start: int = 10_000) -> None:
    """`n` distinct prompts of 4 full blocks each: enough to cycle the whole free queue."""
    for i in range(n):
        run(kv, f"flood-{i}", list(range(start + i * 100, start + i * 100 + 4 * BS + 1)))


def assert_no_leak(kv: KVCacheManager) -> None:
    """Every block is free or pinned-and-free; no reference is left."""
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv.block_tables
    assert kv.pool.num_free_blocks + len(kv.pool._pinned_free) == kv.num_blocks


PINNED = list(range(1, 4 * BS + 3))  # 4 full blocks + 2 tokens
OTHER = list(range(500, 500 + 4 * BS + 2))


def test_a_pinned_prefix_survives_a_flood_that_evicts_an_unpinned_one() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    assert run(kv, "pin", PINNED, pins=((4 * BS, 300.0),)) == 0
    assert run(kv, "other", OTHER) == 0
    assert kv.num_pinned_blocks == 4
    flood(kv, 8)
    assert run(kv, "other-again", OTHER) == 0  # evicted by the flood
    assert run(kv, "pin-again", PINNED) == 4 * BS  # still there
    assert_no_leak(kv)


def test_only_full_blocks_inside_the_pinned_prefix_are_pinned() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    run(kv, "pin", PINNED, pins=((2 * BS + 3, 300.0),))  # 2 whole blocks + 3 tokens
    assert kv.num_pinned_blocks == 2
    flood(kv, 8)
    assert run(kv, "again", PINNED) == 2 * BS


def test_a_pin_expires_after_its_ttl_and_falls_back_to_lru() -> None:
    clock = Clock()
    kv = KVCacheManager(num_blocks=16, block_size=BS, clock=clock)
    run(kv, "pin", PINNED, pins=((4 * BS, 300.0),))
    clock.now += 299.0
    assert kv.num_pinned_blocks == 4
    clock.now += 2.0
    assert kv.num_pinned_blocks == 0  # the stats no longer count it
    flood(kv, 8)
    assert kv.pool.num_pinned_blocks == 0
    assert run(kv, "again", PINNED) == 0  # evicted like any LRU block
    assert_no_leak(kv)


def test_a_hit_refreshes_the_pins_ttl() -> None:
    clock = Clock()
    kv = KVCacheManager(num_blocks=16, block_size=BS, clock=clock)
    run(kv, "pin", PINNED, pins=((4 * BS, 300.0),))
    clock.now += 250.0
    assert run(kv, "hit", PINNED) == 4 * BS  # a plain hit, no pins of its own
    clock.now += 250.0  # 500 s after the pin, 250 s after the hit
    flood(kv, 8)
    assert run(kv, "again", PINNED) == 4 * BS
    clock.now += 301.0
    flood(kv, 8)
    assert run(kv, "expired", PINNED) == 0


def test_the_longest_ttl_covering_a_block_wins() -> None:
    clock = Clock()
    kv = KVCacheManager(num_blocks=16, block_size=BS, clock=clock)
    run(kv, "pin", PINNED, pins=((2 * BS, 3600.0), (4 * BS, 300.0)))
    clock.now += 600.0  # the 5-minute pin is gone, the hour-long one holds
    assert kv.num_pinned_blocks == 2
    flood(kv, 8)
    assert run(kv, "again", PINNED) == 2 * BS


def test_pins_beyond_the_cap_degrade_to_plain_lru() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_pinned=3)
    run(kv, "pin", PINNED, pins=((4 * BS, 300.0),))
    assert kv.num_pinned_blocks == 3
    assert kv.pool.num_free_blocks == 13
    flood(kv, 8)
    assert run(kv, "again", PINNED) == 3 * BS  # the pinned three; the fourth was evicted


def test_the_default_cap_is_half_the_pool() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    for i in range(4):
        tokens = list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * BS + 1))
        run(kv, f"pin-{i}", tokens, pins=((4 * BS, 300.0),))
    assert kv.num_pinned_blocks == 8
    flood(kv, 8)  # 8 unpinned blocks still serve every request
    assert_no_leak(kv)


def test_a_private_copy_pins_the_cached_block() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    # Two requests prefill the same prompt together: the second's copies stay private.
    a, b = make_request("a", PINNED), make_request("b", PINNED, pins=((4 * BS, 300.0),))
    assert kv.allocate_slots(a, len(PINNED))
    assert kv.allocate_slots(b, len(PINNED))
    assert kv.num_pinned_blocks == 4
    assert {kv.pool._cached[h].block_id for h in kv._hashes["b"]} <= set(kv.block_ids("a"))
    kv.free(a)
    kv.free(b)
    flood(kv, 8)
    assert run(kv, "again", PINNED) == 4 * BS
    assert_no_leak(kv)


def test_a_request_that_cannot_run_otherwise_takes_pinned_blocks_back() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run(kv, "pin", PINNED, pins=((4 * BS, 300.0),))
    assert kv.pool.num_free_blocks == 4
    s = Scheduler(kv, max_num_batched_tokens=64)
    # 7 blocks for a request alone: it would wait forever for the pins' deadline.
    s.add_request(make_request("big", list(range(3000, 3000 + 6 * BS)), max_tokens=BS))
    for _ in range(2 * BS):
        out = s.schedule()
        s.update(out, {r.request_id: 7 for r, _ in out.scheduled})
    assert not s.has_work
    assert kv.num_pinned_blocks < 4
    assert_no_leak(kv)


def test_preemption_and_abort_of_pinning_requests_leak_nothing() -> None:
    clock = Clock()
    kv = KVCacheManager(num_blocks=12, block_size=BS, clock=clock)
    s = Scheduler(kv, max_num_batched_tokens=64)
    prompt = list(range(1, 2 * BS + 2))
    for rid in ("a", "b", "c", "d"):
        s.add_request(make_request(rid, [ord(rid), *prompt], ((2 * BS, 300.0),),
                                   max_tokens=8))
    for step in range(200):
        if step == 3:
            assert s.abort("d") is not None
        out = s.schedule()
        s.update(out, {r.request_id: 7 for r, _ in out.scheduled})
        if not s.has_work:
            break
    assert s.num_preemptions > 0
    assert not s.has_work
    assert_no_leak(kv)
    assert 0 < kv.num_pinned_blocks <= 6
    clock.now += 301.0
    assert kv.num_pinned_blocks == 0
    kv.pool.expire_pins()
    assert kv.pool.num_free_blocks == 12  # every pin expired: the whole pool is free


def test_reset_prefix_cache_drops_the_pins() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    run(kv, "pin", PINNED, pins=((4 * BS, 300.0),))
    kv.pool.reset_prefix_cache()
    assert kv.num_pinned_blocks == 0 and kv.pool.num_free_blocks == 16
    assert run(kv, "again", PINNED) == 0


def test_pins_cross_the_wire_and_older_bodies_decode_without_them() -> None:
    body = GenerateRequest("r", [1, 2, 3], SamplingParams(), pins=[(32, 300.0)]).to_json()
    assert GenerateRequest.from_json(body).pins == [(32, 300.0)]
    del body["pins"]
    assert GenerateRequest.from_json(body).pins == []
    stats = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "num_kv_blocks": 8,
             "num_free_kv_blocks": 8, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
             "num_preemptions": 0, "num_computed_tokens": 0}
    assert stats_from_json(stats).num_pinned_kv_blocks == 0


def test_cache_writes_split_new_tokens_by_the_longest_covering_ttl() -> None:
    assert cache_writes([], 0) == (0, 0)
    assert cache_writes([(64, 300.0)], 0) == (64, 0)
    assert cache_writes([(64, 300.0)], 64) == (0, 0)  # a read, no write
    assert cache_writes([(32, 3600.0), (64, 300.0)], 16) == (32, 16)
    assert cache_writes([(64, 3600.0), (32, 300.0)], 0) == (0, 64)
