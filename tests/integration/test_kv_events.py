"""Precise prefix routing over real engines (issue 25): each `tokenyard engine` publishes
its KV-cache events (vLLM's format, ZMQ, CURVE keys from the replica token) and the
gateway's `precise` policy routes by the blocks each replica reports.

- A subscriber holding the token gets a request's blocks: the engine's own hash chain,
  the salt's hash, no token ids; replay from 0 starts with AllBlocksCleared. One without
  the token gets nothing. The replica's /metrics has vLLM's names (behind the token).
- Two replicas behind `tokenyard serve` with `policy = "precise"`: a repeated long prompt
  goes to the replica that holds it, every time, and is served from its cache.
- `kill -9` and a restart of a replica: its entries leave the gateway-side index at once
  (the connection's end), and the restarted replica's new blocks come back.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from tests.integration import test_fleet
from tests.integration.test_fleet import Engine, chat, replicas, serve_fleet
from tokenyard.balancer.kv_index import KVIndex, KVWatcher
from tokenyard.balancer.replica_client import ReplicaClient
from tokenyard.wire.block_hash import block_key, hash_prompt_blocks, salt_hash
from tokenyard.wire.kv_events import TOPIC, curve_keys, decode_batch, seq_bytes, seq_int
from tokenyard.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

#: Two engines with one token, started once for this module (test_fleet's fixture).
engines = test_fleet.engines


def _sub(ctx: zmq.asyncio.Context, endpoint: str, token: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.linger = 0
    sock.curve_serverkey = curve_keys(token, "server")[0]
    sock.curve_publickey, sock.curve_secretkey = curve_keys(token, "client")
    sock.subscribe(TOPIC)
    sock.connect(endpoint)
    return sock


async def _generate(client: ReplicaClient, prompt: list[int], salt: str) -> None:
    async for _ in client.generate(f"kv-{secrets.token_hex(4)}", prompt,
                                   SamplingParams(max_tokens=1), cache_salt=salt):
        pass


async def _stored(sock: zmq.asyncio.Socket, timeout: float = 20.0) -> list[tuple[object, ...]]:
    """The BlockStored events of the next batch that holds any (each raw event's
    token_ids field checked empty on the way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await sock.poll(500):
            _, _, payload = await sock.recv_multipart()
            raw = [e for e in msgpack.unpackb(payload)[1] if e[0] == "BlockStored"]
            assert all(e[3] == [] for e in raw), raw  # token_ids: never on the wire
            stored = [e for e in decode_batch(payload).events if e[0] == "stored"]
            if stored:
                return stored
    return []


def test_events_carry_a_requests_blocks_salted_and_without_tokens(
        engines: list[Engine]) -> None:
    engine = engines[0]

    async def main() -> None:
        client = ReplicaClient(engine.url, token=engine.token)
        ctx = zmq.asyncio.Context()
        try:
            info = await client.info()
            assert info.kv_events_endpoint and info.kv_events_replay_endpoint
            assert info.kv_events_endpoint.startswith("tcp://127.0.0.1:")
            good = _sub(ctx, info.kv_events_endpoint, engine.token)
            bad = _sub(ctx, info.kv_events_endpoint, "not-the-token")
            await asyncio.sleep(0.5)  # the subscriptions reach the publisher
            prompt = [(7 * i + 3) % 200 + 10 for i in range(5 * info.block_size + 3)]
            await _generate(client, prompt, "org-a")
            stored = await _stored(good)
            hashes = [h for e in stored for h in e[1]]  # type: ignore[attr-defined]
            want = hash_prompt_blocks(prompt, info.block_size, "org-a")
            assert hashes[:5] == want  # the engine's chain, as the gateway computes it
            assert {e[3] for e in stored} == {salt_hash("org-a")}
            assert not await _stored(bad, timeout=1.0)  # CURVE: no token, no events
            # Replay from 0: the replica's first batch is AllBlocksCleared.
            dealer = ctx.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.curve_serverkey = curve_keys(engine.token, "server")[0]
            dealer.curve_publickey, dealer.curve_secretkey = curve_keys(engine.token, "client")
            dealer.connect(info.kv_events_replay_endpoint)
            await dealer.send_multipart([b"", seq_bytes(0)])
            assert await dealer.poll(5000)
            first = [f for f in await dealer.recv_multipart() if f]
            assert seq_int(first[0]) == 0
            assert decode_batch(first[1]).events[0] == ("cleared",)
            # The replica's /metrics, under vLLM's names too, behind the token.
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{engine.url}/metrics") as resp:
                    assert resp.status == 401
                async with http.get(f"{engine.url}/metrics", headers={
                        "Authorization": f"Bearer {engine.token}"}) as resp:
                    assert resp.status == 200
                    text = await resp.text()
            samples = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                       for line in text.splitlines() if line.startswith("vllm:")}
            assert samples["vllm:num_requests_running"] == 0
            assert samples["vllm:num_requests_waiting"] == 0
            assert 0 <= samples["vllm:kv_cache_usage_perc"] <= 1
            assert samples["vllm:prefix_cache_queries_total"] >= len(prompt)
            assert "vllm:prefix_cache_hits_total" in samples
        finally:
            await client.close()
            ctx.destroy(linger=0)

    asyncio.run(main())


def test_precise_routes_a_repeated_prompt_to_its_holder(
        engines: list[Engine], tmp_path: Path) -> None:
    system = " ".join(f"Policy clause {i}: the tenant keeps record {i} for audits."
                      for i in range(30))
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Summarise the clauses."}]

    async def main(fleet: object) -> None:
        async with aiohttp.ClientSession() as session:
            served: list[str] = []
            cached = []
            for _ in range(4):
                before = await replicas(session, fleet)  # type: ignore[arg-type]
                status, body = await chat(session, fleet.server, messages)  # type: ignore[attr-defined]
                assert status == 200, body
                cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
                after = await replicas(session, fleet)  # type: ignore[arg-type]
                served += [r for r in after if after[r]["served"] > before[r]["served"]]
                await asyncio.sleep(0.3)  # the events of its blocks arrive
            assert len(set(served)) == 1, served
            assert all(c > 0 for c in cached[1:]), cached
            # The gateway routed by the replicas' own reports: both stream their events,
            # and its index holds the served replica's blocks of the prompt.
            view = await replicas(session, fleet)  # type: ignore[arg-type]
            assert all(row["kv_events"] for row in view.values()), view
            assert view[served[0]]["kv_index_blocks"] > 0, view

    with serve_fleet(engines, tmp_path, "precise") as fleet:
        asyncio.run(main(fleet))


def test_a_restarted_replicas_entries_leave_at_once(engines: list[Engine]) -> None:
    engine = engines[1]

    async def main() -> None:
        client = ReplicaClient(engine.url, token=engine.token)
        index = KVIndex()
        watcher = KVWatcher(index, "r", client, stale_s=30.0, retry_s=0.5)
        watcher.start()
        try:
            info = await client.info()
            prompt = [(11 * i + 5) % 300 + 20 for i in range(4 * info.block_size)]
            keys = [block_key(h) for h in hash_prompt_blocks(prompt, info.block_size, "t")]
            await _generate(client, prompt, "t")
            await _until(lambda: index.lookup(keys).get("r") == 4)
            engine.kill()
            began = time.monotonic()
            await _until(lambda: index.blocks_of("r") == 0)
            # Not the 30 s of silence it would take without the connection's end.
            assert time.monotonic() - began < 5
            engine.start()  # same port, new event endpoints
            await _until(lambda: "r" in index.synced)
            assert not index.lookup(keys)
            await _generate(client, prompt, "t")
            await _until(lambda: index.lookup(keys).get("r") == 4)
        finally:
            await watcher.close()
            await client.close()

    asyncio.run(main())


async def _until(cond: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)
