"""The KV-event wire format (vLLM's shape) and the balancer's block index."""

from __future__ import annotations

from typing import Any

import msgpack

from tokenyard.balancer.kv_index import KVIndex
from tokenyard.engine.kv_cache import BlockPool
from tokenyard.wire.block_hash import block_key, hash_prompt_blocks, salt_hash
from tokenyard.wire.kv_events import EventBatch, decode_batch, encode_batch


def test_a_batch_is_vllms_kv_event_batch() -> None:
    a, b = hash_prompt_blocks(list(range(32)), 16, "org-a")
    raw = msgpack.unpackb(encode_batch(
        1.5, [("cleared",), ("stored", a, None, "org-a", tuple(range(16))),
              ("stored", b, a, "org-a", tuple(range(16, 32))), ("removed", a)], 16, "CPU"))
    ts, events = raw
    assert ts == 1.5
    assert events[0] == ["AllBlocksCleared"]
    # [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
    #  lora_name, extra_keys]: one chain in one event, no token ids, the salt's hash only.
    # The medium is where the pool lives (a CPU replica's says "CPU").
    assert events[1] == ["BlockStored", [a, b], None, [], 16, None, "CPU", None,
                         [[salt_hash("org-a")], [salt_hash("org-a")]]]
    assert events[2] == ["BlockRemoved", [a], "CPU"]
    assert decode_batch(encode_batch(1.5, [("stored", a, None, None, ())], 16)).events == [
        ("stored", [a], None, None)]


def test_the_pool_records_stored_and_evicted_blocks() -> None:
    pool = BlockPool(2)
    pool.events = []
    [blk] = pool.allocate(1)
    h = hash_prompt_blocks(list(range(16)), 16, "t")[0]
    pool.cache_full_block(blk, h, list(range(16)), None, "t")
    pool.free([blk])
    pool.allocate(2)  # reuses the freed block: its hash is evicted
    # The raw salt and the tokens stay in the replica: each publisher encodes its own.
    assert pool.take_events() == [("stored", h, None, "t", tuple(range(16))), ("removed", h)]
    assert pool.take_events() == []


def test_lookup_touches_only_the_prompts_blocks() -> None:
    """O(prompt blocks): 100,000 blocks indexed, a 10-block prompt reads 10 entries."""

    class Counting(dict[int, set[str]]):
        reads = 0

        def get(self, key: int, default: Any = None) -> Any:
            Counting.reads += 1
            return super().get(key, default)

    index = KVIndex(max_blocks=60_000)
    index._holders = Counting()
    for member in ("r1", "r2"):
        hashes = hash_prompt_blocks(list(range(50_000 * 4)), 4, member)
        index.apply(member, EventBatch(0.0, [("stored", hashes, None, None)]))
    prompt = hash_prompt_blocks(list(range(40)), 4, "r2")
    Counting.reads = 0
    assert index.lookup([block_key(h) for h in prompt]) == {"r2": 10}
    assert Counting.reads <= 10
    assert len(index) == 100_000


def test_the_index_is_bounded_and_forgets_a_member() -> None:
    index = KVIndex(max_blocks=8)
    hashes = hash_prompt_blocks(list(range(64)), 4, None)
    index.apply("r1", EventBatch(0.0, [("stored", hashes, None, None)]))
    assert index.blocks_of("r1") == 8 and len(index) == 8  # the oldest 8 dropped
    index.apply("r1", EventBatch(0.0, [("removed", hashes[-2:])]))
    assert index.blocks_of("r1") == 6
    index.apply("r1", EventBatch(0.0, [("cleared",)]))
    assert index.blocks_of("r1") == 0 and len(index) == 0
