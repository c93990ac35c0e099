"""The replica's KV-event publisher (the format and transport: `wire/kv_events.py`).

The step thread hands over each step's prefix-cache changes (`publish`); this thread owns
the two ZMQ sockets (sockets are not thread-safe): it numbers and publishes the batches,
keeps the last `buffer_steps` for replay, answers replay requests, and sends an empty
batch each `heartbeat_s` when idle so that a subscriber can tell a live replica from a
gone one (it repeats the last batch's number). Both sockets bind the replica's own host
on free ports; with a token they are CURVE servers that admit only the token's client
key.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.auth.thread

from tokenyard.wire.kv_events import END_SEQ, TOPIC, curve_keys, encode_batch, seq_bytes, seq_int

log = logging.getLogger("tokenyard.engine")


class _AllowKey:
    """ZAP: admit the one client key derived from the token."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


class KVEventPublisher:
    def __init__(self, host: str, block_size: int, *, token: str | None = None,
                 buffer_steps: int = 10_000, heartbeat_s: float = 1.0) -> None:
        self.block_size = block_size
        self.heartbeat_s = heartbeat_s
        self._queue: queue.SimpleQueue[tuple[float, Sequence[tuple[object, ...]]] | None] = (
            queue.SimpleQueue())
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._ctx = zmq.Context()
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self.pub = self._ctx.socket(zmq.PUB)
        self.replay = self._ctx.socket(zmq.ROUTER)
        if token is not None:
            self._auth = zmq.auth.thread.ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback(
                "*", credentials_provider=_AllowKey(curve_keys(token, "client")[0]))
            public, secret = curve_keys(token, "server")
            for sock in (self.pub, self.replay):
                sock.curve_secretkey = secret
                sock.curve_publickey = public
                sock.curve_server = True
        for sock in (self.pub, self.replay):
            sock.linger = 0
        shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
        if ":" in host:
            self.pub.ipv6 = self.replay.ipv6 = True
        self.pub.bind(f"tcp://{shown}:*")
        self.replay.bind(f"tcp://{shown}:*")
        self.endpoint: str = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
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
        poller.register(self.replay, zmq.POLLIN)
        last_sent = 0.0
        try:
            while True:
                item: tuple[float, Sequence[tuple[object, ...]]] | None
                try:
                    item = self._queue.get(timeout=0.25)  # the replay waits at most this
                except queue.Empty:
                    item = (time.time(), [])  # a heartbeat, if one is due
                    if time.monotonic() - last_sent < self.heartbeat_s:
                        item = (0.0, [])
                if item is None:
                    return
                if item[0]:
                    self._send(*item)
                    last_sent = time.monotonic()
                while poller.poll(0):
                    self._answer_replay(self.replay.recv_multipart())
        except zmq.ZMQError as exc:  # the context was destroyed under us: shutting down
            log.debug("KV event publisher stopped: %s", exc)

    def _send(self, ts: float, events: Sequence[tuple[object, ...]]) -> None:
        payload = encode_batch(ts, events, self.block_size)
        if events:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        else:  # a heartbeat repeats the last number: no gap, nothing to replay
            seq = self._seq - 1
        self.pub.send_multipart([TOPIC, seq_bytes(seq), payload])

    def _answer_replay(self, frames: list[bytes]) -> None:
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
