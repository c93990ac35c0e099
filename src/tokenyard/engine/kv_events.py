"""The replica's KV-event publishers: tokenyard's own (`wire/kv_events.py`) for its
gateways, and optionally vLLM's (`wire/vllm_kv_events.py`) for outside routers.

The step thread hands over each step's prefix-cache changes (`publish`); a publisher's
thread owns its ZMQ sockets (sockets are not thread-safe): it numbers and publishes the
batches, keeps the last `buffer_steps` for replay, answers replay requests, and (its own
format only) sends an empty batch each `heartbeat_s` when idle so that a subscriber can
tell a live replica from a gone one (it repeats the last batch's number). tokenyard's
sockets bind the replica's own host on free ports; with a token they are CURVE servers
that admit only the token's client key. vLLM's bind what the operator configured
(`config.KVEventsConfig`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
import zmq.auth.thread

from tokenyard.config import KVEventsConfig
from tokenyard.wire.kv_events import END_SEQ, TOPIC, curve_keys, encode_batch, seq_bytes, seq_int
from tokenyard.wire.vllm_kv_events import VllmEventEncoder

log = logging.getLogger("tokenyard.engine")


class _AllowKeys:
    """ZAP: admit only these client public keys."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


@dataclass(frozen=True)
class Curve:
    """A CURVE server's key pair (Z85) and the client public keys (Z85) it admits."""

    public: bytes
    secret: bytes
    clients: frozenset[bytes]


Encode = Callable[[float, Sequence[tuple[object, ...]]], bytes]


class KVEventPublisher:
    """One PUB socket (and an optional replay ROUTER) publishing the step thread's events
    as `encode` writes them, under `topic`, numbered from 0. `heartbeat_s`: an empty
    batch repeating the last number when idle this long (None: never, as vLLM)."""

    def __init__(self, encode: Encode, endpoint: str, replay_endpoint: str | None, *,
                 topic: bytes, curve: Curve | None = None, buffer_steps: int = 10_000,
                 heartbeat_s: float | None = 1.0) -> None:
        self._encode = encode
        self._topic = topic
        self.heartbeat_s = heartbeat_s
        self._queue: queue.SimpleQueue[tuple[float, Sequence[tuple[object, ...]]] | None] = (
            queue.SimpleQueue())
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._ctx = zmq.Context()
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self.pub = self._ctx.socket(zmq.PUB)
        self.replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        sockets = [s for s in (self.pub, self.replay) if s is not None]
        if curve is not None:
            self._auth = zmq.auth.thread.ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback(
                "*", credentials_provider=_AllowKeys(curve.clients))
            for sock in sockets:
                sock.curve_secretkey = curve.secret
                sock.curve_publickey = curve.public
                sock.curve_server = True
        for sock in sockets:
            sock.linger = 0
            sock.ipv6 = "[" in endpoint or "[" in (replay_endpoint or "")
        self.pub.bind(endpoint)
        self.endpoint: str = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = None
        if self.replay is not None and replay_endpoint:
            self.replay.bind(replay_endpoint)
            self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queue.put((time.time(), [("cleared",)]))  # a (re)started replica holds nothing
        self._thread = threading.Thread(target=self._run, name="tokenyard-kv-events",
                                        daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[tuple[object, ...]]) -> None:
        """One step's events (from the step thread; never blocks)."""
        self._queue.put((time.time(), events))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        last_sent = 0.0
        try:
            while True:
                item: tuple[float, Sequence[tuple[object, ...]]] | None
                try:
                    item = self._queue.get(timeout=0.25)  # the replay waits at most this
                except queue.Empty:
                    item = (time.time(), [])  # a heartbeat, if one is due
                    if (self.heartbeat_s is None
                            or time.monotonic() - last_sent < self.heartbeat_s):
                        item = (0.0, [])
                if item is None:
                    return
                if item[0]:
                    self._send(*item)
                    last_sent = time.monotonic()
                while self.replay is not None and poller.poll(0):
                    self._answer_replay(self.replay.recv_multipart())
        except zmq.ZMQError as exc:  # the context was destroyed under us: shutting down
            log.debug("KV event publisher stopped: %s", exc)

    def _send(self, ts: float, events: Sequence[tuple[object, ...]]) -> None:
        payload = self._encode(ts, events)
        if events:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        else:  # a heartbeat repeats the last number: no gap, nothing to replay
            seq = self._seq - 1
        self.pub.send_multipart([self._topic, seq_bytes(seq), payload])

    def _answer_replay(self, frames: list[bytes]) -> None:
        assert self.replay is not None
        identity, rest = frames[0], frames[1:]
        envelope = [identity, b""] if rest and rest[0] == b"" else [identity]
        body = [f for f in rest if f]
        if len(body) != 1 or len(body[0]) != 8:
            with contextlib.suppress(zmq.ZMQError):
                self.replay.send_multipart([*envelope, END_SEQ, b""])
            return
        start = seq_int(body[0])
        for seq, payload in self._buffer:
            if seq >= start:
                self.replay.send_multipart([*envelope, seq_bytes(seq), payload])
        self.replay.send_multipart([*envelope, END_SEQ, b""])


def tokenyard_publisher(host: str, block_size: int, medium: str, *,
                        token: str | None = None) -> KVEventPublisher:
    """tokenyard's own events for its gateways (`wire/kv_events.py`): free ports on the
    replica's host, CURVE keys derived from the replica token when there is one."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    curve = None
    if token is not None:
        public, secret = curve_keys(token, "server")
        curve = Curve(public, secret, frozenset({curve_keys(token, "client")[0]}))
    return KVEventPublisher(
        lambda ts, events: encode_batch(ts, events, block_size, medium),
        f"tcp://{shown}:*", f"tcp://{shown}:*", topic=TOPIC, curve=curve)


def vllm_publisher(config: KVEventsConfig, block_size: int, medium: str) -> KVEventPublisher:
    """vLLM's own events (`wire/vllm_kv_events.py`) where `config` says, for outside
    routers; no heartbeat, as vLLM sends none."""
    assert config.vllm_endpoint is not None
    curve = None
    if config.curve_secret_key is not None:
        secret = config.curve_secret_key.encode()
        curve = Curve(zmq.curve_public(secret), secret,
                      frozenset(k.encode() for k in config.client_keys))
    encoder = VllmEventEncoder(block_size, medium, config.vllm_hash_seed)
    return KVEventPublisher(encoder.encode, config.vllm_endpoint, config.vllm_replay_endpoint,
                            topic=config.vllm_topic.encode(), curve=curve, heartbeat_s=None)
