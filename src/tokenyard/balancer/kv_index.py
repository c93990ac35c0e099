"""Which replica really holds which prefix block: an index fed by the replicas' KV events.

Each engine replica publishes its prefix cache's changes (`wire/kv_events.py`); a
`KVIndex` keeps block key (`wire/block_hash.block_key`) → the members holding it, and a
`KVWatcher` per member keeps it current: it reads the member's info for the endpoints,
subscribes, replays from 0 to learn what the replica already holds, replays again on a
sequence gap, and on a replica that went quiet (no batch or heartbeat for `stale_s`) or
restarted (its numbering starts again with AllBlocksCleared) drops the member's entries
and subscribes afresh. Members without events (upstreams, older replicas) are simply
never `synced`: the policy falls back to its approximate table for them.

Memory is bounded per member (`max_blocks`, at least the replica's KV pool: it cannot
hold more), and `lookup` costs O(prompt blocks × members holding them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

import zmq
import zmq.asyncio

from tokenyard.wire.block_hash import block_key
from tokenyard.wire.kv_events import TOPIC, EventBatch, curve_keys, decode_batch, seq_bytes, seq_int

logger = logging.getLogger("tokenyard.balancer")

_WILDCARD = {"0.0.0.0", "*", "::", "[::]"}


class KVIndex:
    """Block key → the members holding it, bounded per member."""

    def __init__(self, max_blocks: int = 200_000) -> None:
        self.max_blocks = max_blocks
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        #: Members whose events are current (the others fall back).
        self.synced: set[str] = set()

    def __len__(self) -> int:
        return len(self._holders)

    def blocks_of(self, member: str) -> int:
        return len(self._blocks.get(member, ()))

    def apply(self, member: str, batch: EventBatch) -> None:
        held = self._blocks.setdefault(member, OrderedDict())
        for ev in batch.events:
            if ev[0] == "stored":
                for h in ev[1]:  # type: ignore[attr-defined]
                    key = block_key(h) if isinstance(h, bytes) else int(h)
                    self._holders.setdefault(key, set()).add(member)
                    held[key] = None
                    held.move_to_end(key)
                while len(held) > self.max_blocks:
                    self._drop(member, held.popitem(last=False)[0])
            elif ev[0] == "removed":
                for h in ev[1]:  # type: ignore[attr-defined]
                    key = block_key(h) if isinstance(h, bytes) else int(h)
                    if held.pop(key, 1) is None:
                        self._drop(member, key)
            else:
                self.clear(member)
                held = self._blocks.setdefault(member, OrderedDict())

    def _drop(self, member: str, key: int) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(member)
            if not holders:
                del self._holders[key]

    def clear(self, member: str) -> None:
        """Forget everything `member` held (a restart, a lost stream)."""
        for key in self._blocks.pop(member, ()):
            self._drop(member, key)

    def lookup(self, keys: Sequence[int]) -> dict[str, int]:
        """For each member, how many leading `keys` it holds (0s omitted)."""
        depth: dict[str, int] = {}
        if not keys:
            return depth
        alive = set(self._holders.get(keys[0], ()))
        i = 0
        while alive:
            i += 1
            for m in alive:
                depth[m] = i
            if i == len(keys):
                break
            alive &= self._holders.get(keys[i], set())
        return depth


def _endpoint(advertised: str, base_url: str) -> str:
    """The advertised endpoint, its wildcard host replaced by the one we reach it at."""
    scheme, _, rest = advertised.partition("://")
    host, _, port = rest.rpartition(":")
    if host in _WILDCARD:
        host = urlparse(base_url).hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def _token_of(client: Any) -> str | None:
    headers = getattr(client, "_headers", None) or {}
    value = headers.get("Authorization", "")
    return value[7:] if value.startswith("Bearer ") else None


class KVWatcher:
    """One member's subscription (see the module's docstring)."""

    def __init__(self, index: KVIndex, member_id: str, client: Any, *,
                 stale_s: float = 3.0, retry_s: float = 5.0) -> None:
        self.index = index
        self.member_id = member_id
        self.client = client
        self.stale_s = stale_s
        self.retry_s = retry_s
        self.task: asyncio.Task[None] | None = None
        self._ctx = zmq.asyncio.Context.instance()

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
            self.task = None
        self.index.synced.discard(self.member_id)
        self.index.clear(self.member_id)

    async def _run(self) -> None:
        while True:
            try:
                info = await self.client.info()
            except Exception:  # down or not a replica: try later
                await asyncio.sleep(self.retry_s)
                continue
            pub = getattr(info, "kv_events_endpoint", None)
            replay = getattr(info, "kv_events_replay_endpoint", None)
            if not pub or not replay:  # an older replica, or caching off: fall back
                await asyncio.sleep(self.retry_s * 6)
                continue
            base = getattr(self.client, "base_url", "")
            try:
                await self._follow(_endpoint(pub, base), _endpoint(replay, base))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("KV events of %s: %s", self.member_id, exc)
            self.index.synced.discard(self.member_id)
            self.index.clear(self.member_id)
            await asyncio.sleep(0.1)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.linger = 0
        token = _token_of(self.client)
        if token is not None:
            sock.curve_serverkey = curve_keys(token, "server")[0]
            sock.curve_publickey, sock.curve_secretkey = curve_keys(token, "client")
        return sock

    async def _replay(self, endpoint: str, start: int) -> list[tuple[int, bytes]]:
        sock = self._socket(zmq.DEALER)
        try:
            sock.connect(endpoint)
            await sock.send_multipart([b"", seq_bytes(start)])
            out: list[tuple[int, bytes]] = []
            while True:
                if not await sock.poll(self.stale_s * 1000):
                    raise TimeoutError("the replay endpoint did not answer")
                frames = [f for f in await sock.recv_multipart() if f]
                if not frames or seq_int(frames[0]) < 0:
                    return out
                out.append((seq_int(frames[0]), frames[1]))
        finally:
            sock.close()

    async def _follow(self, pub: str, replay: str) -> None:
        sub = self._socket(zmq.SUB)
        # A replica that exits closes the connection: its entries go at once, not after
        # `stale_s` of silence.
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            sub.subscribe(TOPIC)
            sub.connect(pub)
            # Subscribed before the replay: what happens meanwhile arrives live too.
            self.index.clear(self.member_id)
            expected = 0
            for seq, payload in await self._replay(replay, 0):
                self.index.apply(self.member_id, decode_batch(payload))
                expected = seq + 1
            self.index.synced.add(self.member_id)
            while True:
                ready = dict(await poller.poll(self.stale_s * 1000))
                if not ready or monitor in ready:
                    return  # disconnected, or quiet past its heartbeats: gone
                _, raw_seq, payload = await sub.recv_multipart()
                seq = seq_int(raw_seq)
                batch = decode_batch(payload)
                if seq < expected:
                    if seq == 0 and batch.events[:1] == [("cleared",)]:
                        expected = 0  # restarted on the same port: start over
                    else:
                        continue  # a heartbeat, or already replayed
                if seq > expected:  # a gap: fetch what we missed
                    missed = [(r, p) for r, p in await self._replay(replay, expected) if r < seq]
                    if not missed or missed[0][0] != expected:
                        return  # the buffer no longer has it: start over
                    for _, rpayload in missed:
                        self.index.apply(self.member_id, decode_batch(rpayload))
                self.index.apply(self.member_id, batch)
                expected = seq + 1
        finally:
            sub.disable_monitor()
            monitor.close()
            sub.close()
