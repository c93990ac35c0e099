from tokenyard.engine.kv_cache import BlockPool, KVCacheManager, hash_prompt_blocks
from tokenyard.engine.request import Request
from tokenyard.wire.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def test_block_hash_chain_depends_on_every_earlier_block_and_the_salt() -> None:
    a = hash_prompt_blocks(list(range(48)), 16, None)
    b = hash_prompt_blocks([99, *range(1, 48)], 16, None)
    c = hash_prompt_blocks(list(range(48)), 16, "org-2")
    assert len(a) == 3
    assert all(x != y for x, y in zip(a, b, strict=True))  # first token changes the chain
    assert all(x != y for x, y in zip(a, c, strict=True))  # the salt separates tenants
    assert hash_prompt_blocks(list(range(48)), 16, None) == a  # stable


def test_second_request_sharing_a_prefix_reuses_its_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(10)))
    assert kv.allocate_slots(first, 10)
    first.num_computed_tokens = 10
    second = make_request("b", [*range(8), 77, 78, 79])
    hits = kv.find_cached_prefix(second)
    assert [b.block_id for b in hits] == kv.block_ids("a")[:2]
    second.num_computed_tokens = 8
    assert kv.allocate_slots(second, 3, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert hits[0].ref_cnt == 2


def test_cache_salt_prevents_a_hit_across_tenants() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(12)), salt="org-1")
    assert kv.allocate_slots(first, 12)
    assert kv.find_cached_prefix(make_request("b", list(range(12)), salt="org-2")) == []
    assert len(kv.find_cached_prefix(make_request("c", list(range(12)), salt="org-1"))) == 2


def test_a_fully_cached_prompt_still_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(8)))
    assert kv.allocate_slots(first, 8)
    assert len(kv.find_cached_prefix(make_request("b", list(range(8))))) == 1


def test_freed_blocks_keep_their_hash_until_reused_lru_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    first = make_request("a", list(range(9)))
    assert kv.allocate_slots(first, 9)  # 3 blocks, two full
    kv.free(first)
    assert kv.pool.num_free_blocks == 4
    again = make_request("b", list(range(9)))
    assert len(kv.find_cached_prefix(again)) == 2  # still cached after free
    # Three fresh blocks: the two uncached ones go first, then the least recently freed
    # cached block, which is the tail of "a" (freed tail first); its first block survives.
    other = make_request("c", [50] * 12)
    assert kv.allocate_slots(other, 12)
    assert len(kv.find_cached_prefix(make_request("d", list(range(9))))) == 1


def test_the_pool_counts_the_cached_blocks_it_evicts_to_make_room() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    first = make_request("a", list(range(9)))
    assert kv.allocate_slots(first, 9)  # two full (cached) blocks and a partial one
    kv.free(first)
    assert kv.pool.num_evicted == 0
    assert kv.allocate_slots(make_request("b", [50] * 8), 8)  # the free uncached ones
    assert kv.pool.num_evicted == 0
    assert kv.allocate_slots(make_request("c", [60] * 8), 8)  # both cached ones go
    assert kv.pool.num_evicted == 2


def test_allocation_fails_cleanly_when_the_pool_is_short() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", list(range(12)))
    assert not kv.allocate_slots(request, 12)
    assert kv.pool.num_free_blocks == 2
    assert kv.block_ids("a") == []


def test_hit_is_verified_against_stored_tokens() -> None:
    pool = BlockPool(2)
    block = pool.allocate(1)[0]
    pool.cache_full_block(block, b"h", (1, 2, 3))
    assert pool.lookup(b"h", (1, 2, 3)) is block
    assert pool.lookup(b"h", (1, 2, 4)) is None  # a colliding hash is a miss
