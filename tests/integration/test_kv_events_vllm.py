"""KV events an outside router can read (issue 40, part 6): with
TOKENYARD_KV_EVENTS_VLLM_ENDPOINT a replica also publishes its prefix cache's events
exactly as vLLM does, and a router built for vLLM places a prompt on the replica that
holds it.

- The payload is what vLLM's own msgspec structs (`vllm/distributed/kv_events.py`,
  written out below from its published definitions) encode, byte for byte.
- The block hash is vLLM's `sha256_cbor` chain: checked against canonical CBOR bytes
  written out by hand, so a change of encoding shows.
- Two real `tokenyard engine` replicas, one on plain ZMQ (loopback), one behind CURVE
  with operator keys; a subscriber decodes their events with vLLM's structs and feeds an
  indexer that does what llm-d's `kvcache` indexer does (its request keys: FNV-64a over
  the canonical CBOR of ``[parent, tokens, extra]`` from a seed and the model name,
  computed from the events' token ids; engine keys mapped to them; the longest run of a
  prompt's keys per pod). Each prompt scores highest on the replica that served it.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import cbor2
import msgspec
import pytest
import zmq
import zmq.asyncio

from tests.integration.test_fleet import Engine
from tokenyard.balancer.replica_client import ReplicaClient
from tokenyard.config import KVEventsConfig
from tokenyard.wire.sampling_params import SamplingParams
from tokenyard.wire.vllm_kv_events import (
    DEFAULT_HASH_SEED,
    VllmEventEncoder,
    external,
    hash_block,
    hash_prompt,
    none_hash,
)


# vLLM's event definitions, as it publishes them (array-like and tagged: every field is
# written, in order; its publisher stamps data_parallel_rank, 0 without data parallelism).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
BLOCK = 16


def test_the_block_hash_is_sha256_of_canonical_cbor() -> None:
    root = none_hash()
    # (parent, (1, 2, 3), None): array(3), bytes(32), array(3) of 1 2 3, null.
    want = hashlib.sha256(b"\x83\x58\x20" + root + b"\x83\x01\x02\x03\xf6").digest()
    assert hash_block(root, [1, 2, 3], None) == want
    # vLLM's NONE_HASH for sha256: the hash of its seed, a CBOR text string.
    seed = DEFAULT_HASH_SEED.encode()
    assert root == hashlib.sha256(bytes([0x60 + len(seed)]) + seed).digest()
    # The salt is the first block's only extra key; the chain carries it on.
    tokens = list(range(40))
    salted, plain = hash_prompt(tokens, BLOCK, "org-a"), hash_prompt(tokens, BLOCK)
    assert len(salted) == 2 and salted[0] != plain[0] and salted[1] != plain[1]
    assert salted[0] == hash_block(root, tokens[:16], ("org-a",))
    assert salted[1] == hash_block(salted[0], tokens[16:32], None)
    assert external(salted[0]) == int.from_bytes(salted[0][-8:], "big")


def test_a_batch_is_what_vllms_structs_encode_byte_for_byte() -> None:
    enc = VllmEventEncoder(BLOCK, "CPU")
    tokens = list(range(100, 148))
    ours = [bytes([i]) * 16 for i in range(3)]  # tokenyard's own names of the blocks
    payload = enc.encode(7.25, [
        ("cleared",),
        ("stored", ours[0], None, "org-a", tuple(tokens[:16])),
        ("stored", ours[1], ours[0], "org-a", tuple(tokens[16:32])),
        ("stored", ours[2], b"unknown parent", "org-a", tuple(tokens[32:48])),
        ("removed", ours[0]), ("removed", ours[1]), ("removed", ours[2])])
    v = hash_prompt(tokens[:32], BLOCK, "org-a")
    want = msgspec.msgpack.encode(KVEventBatch(ts=7.25, data_parallel_rank=0, events=[
        AllBlocksCleared(),
        BlockStored(block_hashes=[external(v[0]), external(v[1])], parent_block_hash=None,
                    token_ids=tokens[:32], block_size=BLOCK, lora_id=None, medium="CPU",
                    lora_name=None, extra_keys=[("org-a",), None]),
        BlockRemoved(block_hashes=[external(v[0]), external(v[1])], medium="CPU")]))
    assert payload == want
    # A later block of a known chain: its parent named, no extra keys (omitted).
    more = enc.encode(8.0, [("stored", b"a" * 16, None, None, tuple(tokens[:16])),
                            ("stored", b"b" * 16, b"a" * 16, None, tuple(tokens[16:32]))])
    first = enc.encode(9.0, [("stored", b"c" * 16, b"b" * 16, None, tuple(tokens[32:48]))])
    plain = hash_prompt(tokens, BLOCK)
    assert DECODER.decode(more).events[0].extra_keys is None
    [stored] = DECODER.decode(first).events
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == external(plain[1])
    assert stored.block_hashes == [external(plain[2])]
    assert first == msgspec.msgpack.encode(KVEventBatch(
        ts=9.0, data_parallel_rank=0, events=[BlockStored(
            block_hashes=[external(plain[2])], parent_block_hash=external(plain[1]),
            token_ids=tokens[32:48], block_size=BLOCK, lora_id=None, medium="CPU",
            lora_name=None)]))


@pytest.mark.parametrize("endpoint", ["tcp://8.8.8.8:5557", "tcp://0.0.0.0:5557",
                                      "tcp://router.example:5557", "ipc:///tmp/kv"])
def test_plain_zmq_binds_only_a_private_address(endpoint: str) -> None:
    with pytest.raises(ValueError, match="KV events endpoint"):
        KVEventsConfig.from_env(vllm_endpoint=endpoint)
    secret = zmq.curve_keypair()[1].decode()
    client = zmq.curve_keypair()[0].decode()
    if endpoint.startswith("tcp://"):  # with the operator's CURVE keys, any address
        KVEventsConfig.from_env(vllm_endpoint=endpoint, curve_secret_key=secret,
                                curve_client_keys=client)


class LlmdIndexer:
    """What llm-d's kvcache indexer does with vLLM's events, reimplemented: request keys
    from the events' token ids (FNV-64a of canonical CBOR, chained from the seed and the
    model), the engine keys mapped to them, and the pods holding each request key."""

    def __init__(self, model: str, seed: str = "") -> None:
        self.model = model
        self.init = self._hash(self._fnv(seed.encode()), [], model)
        self.request_key: dict[int, int] = {}  # engine key -> request key
        self.pods: dict[int, set[str]] = defaultdict(set)

    @staticmethod
    def _fnv(data: bytes) -> int:
        h = 0xCBF29CE484222325
        for byte in data:
            h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        return h

    def _hash(self, parent: int, tokens: list[int], extra: Any) -> int:
        return self._fnv(cbor2.dumps([parent, tokens or None, extra], canonical=True))

    def keys(self, tokens: list[int], parent: int | None = None) -> list[int]:
        out, prefix = [], self.init if parent is None else parent
        for start in range(0, len(tokens) // BLOCK * BLOCK, BLOCK):
            prefix = self._hash(prefix, tokens[start:start + BLOCK], None)
            out.append(prefix)
        return out

    def apply(self, pod: str, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                parent = None
                if ev.parent_block_hash is not None:
                    parent = self.request_key.get(int(ev.parent_block_hash))  # type: ignore[arg-type]
                    if parent is None:
                        continue
                requests = self.keys(ev.token_ids, parent)
                for engine_key, request_key in zip(ev.block_hashes, requests, strict=True):
                    self.request_key[int(engine_key)] = request_key  # type: ignore[arg-type]
                    self.pods[request_key].add(pod)
            elif isinstance(ev, BlockRemoved):
                for engine_key in ev.block_hashes:
                    key = self.request_key.pop(int(engine_key), None)  # type: ignore[arg-type]
                    if key is not None:
                        self.pods[key].discard(pod)

    def score(self, tokens: list[int]) -> dict[str, int]:
        """Per pod, how many of the prompt's leading blocks it holds in a row."""
        scores: dict[str, int] = {}
        alive: set[str] | None = None
        for key in self.keys(tokens):
            alive = set(self.pods.get(key, ())) if alive is None else alive & self.pods.get(
                key, set())
            if not alive:
                break
            for pod in alive:
                scores[pod] = scores.get(pod, 0) + 1
        return scores


@pytest.fixture(scope="module")
def vllm_replicas() -> Iterator[tuple[list[Engine], tuple[bytes, bytes, bytes]]]:
    """Two engines: the first on plain ZMQ (loopback), the second behind CURVE keys."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    token = secrets.token_urlsafe(16)
    plain = Engine(token, env={"TOKENYARD_KV_EVENTS_VLLM_ENDPOINT": "tcp://127.0.0.1:*",
                               "TOKENYARD_KV_EVENTS_VLLM_TOPIC": "kv@replica-0@smol"})
    curve = Engine(token, env={"TOKENYARD_KV_EVENTS_VLLM_ENDPOINT": "tcp://127.0.0.1:*",
                               "TOKENYARD_KV_EVENTS_VLLM_TOPIC": "kv@replica-1@smol",
                               "TOKENYARD_KV_EVENTS_CURVE_SECRET_KEY": server_secret.decode(),
                               "TOKENYARD_KV_EVENTS_CURVE_CLIENT_KEYS": client_public.decode()})
    started = [plain, curve]
    try:
        for engine in started:
            engine.start()
        yield started, (server_public, client_public, client_secret)
    finally:
        for engine in started:
            engine.stop()


@pytest.mark.slow
def test_an_llmd_style_indexer_finds_each_prompt_on_its_replica(
        vllm_replicas: tuple[list[Engine], tuple[bytes, bytes, bytes]]) -> None:
    engines, (server_public, client_public, client_secret) = vllm_replicas

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        clients = [ReplicaClient(e.url, token=e.token) for e in engines]
        try:
            infos = [await c.info() for c in clients]
            socks = []
            for i, info in enumerate(infos):
                assert info.vllm_kv_events_endpoint, info
                assert info.vllm_kv_events_endpoint.startswith("tcp://127.0.0.1:")
                sock = ctx.socket(zmq.SUB)
                sock.linger = 0
                if i == 1:
                    sock.curve_serverkey = server_public
                    sock.curve_publickey, sock.curve_secretkey = client_public, client_secret
                sock.subscribe(b"kv@")
                sock.connect(info.vllm_kv_events_endpoint)
                socks.append(sock)
            await asyncio.sleep(0.5)  # the subscriptions reach the publishers
            indexer = LlmdIndexer("smol")
            prompts = [[(7 * i + 3 + 50 * r) % 300 + 10 for i in range(4 * BLOCK + 5)]
                       for r in range(2)]
            for client, prompt in zip(clients, prompts, strict=True):
                async for _ in client.generate(f"kv-{secrets.token_hex(4)}", prompt,
                                               SamplingParams(max_tokens=1),
                                               cache_salt="org-a"):
                    pass
            deadline, stored = time.monotonic() + 20, [0, 0]
            while min(stored) < 4 and time.monotonic() < deadline:
                for i, sock in enumerate(socks):
                    while await sock.poll(100):
                        topic, seq, payload = await sock.recv_multipart()
                        assert topic == f"kv@replica-{i}@smol".encode() and len(seq) == 8
                        pod = topic.decode().split("@")[1]  # as llm-d reads it
                        batch = DECODER.decode(payload)
                        for ev in batch.events:
                            if isinstance(ev, BlockStored):
                                assert ev.medium == "CPU" and ev.block_size == BLOCK
                                want = [external(h) for h in hash_prompt(
                                    prompts[i], BLOCK, "org-a")]
                                assert ev.block_hashes == want[:len(ev.block_hashes)]
                                stored[i] += len(ev.block_hashes)
                        indexer.apply(pod, batch)
            assert stored == [4, 4], stored
            for i, prompt in enumerate(prompts):
                assert indexer.score(prompt) == {f"replica-{i}": 4}
            # A subscriber without the operator's client key gets nothing from the second.
            stranger = ctx.socket(zmq.SUB)
            stranger.linger = 0
            stranger.curve_serverkey = server_public
            stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
            stranger.subscribe(b"")
            assert infos[1].vllm_kv_events_endpoint is not None
            stranger.connect(infos[1].vllm_kv_events_endpoint)
            await asyncio.sleep(0.3)
            again = [(11 * i + 5) % 300 + 10 for i in range(2 * BLOCK)]
            async for _ in clients[1].generate("kv-again", again, SamplingParams(max_tokens=1),
                                               cache_salt="org-b"):
                pass
            assert await socks[1].poll(5000)  # the keyed subscriber hears the new blocks
            assert not await stranger.poll(1000)
        finally:
            ctx.destroy(linger=0)

    asyncio.run(main())
