"""The HTTP side's end of a replica's multiplexed channel (`wire/mux.py`): one WebSocket
per replica for all of this process's requests to it, opened on first use and again
after it drops.

One reader task decodes each frame and hands every delta to its request's `Inbox`: a
dict lookup and a deque append per delta, whatever the number of requests open. A
request's caller reads its inbox; leaving before the end sends an abort on the channel.
When the connection drops, every request open on it fails with ReplicaConnectionError
(before its first delta, the balancer then fails it over).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import cast

import aiohttp

from tokenyard.balancer.replica_errors import (
    STREAM_FAILED_MESSAGE,
    ReplicaConnectionError,
    ReplicaError,
    ReplicaStreamError,
    refusal_error,
)
from tokenyard.wire.mux import MUX_PATH, abort_op, decode_frame
from tokenyard.wire.outputs import merge_steps
from tokenyard.wire.protocol import CoreDelta, ProtocolError

logger = logging.getLogger("tokenyard.balancer")


class MuxUnsupported(Exception):
    """The replica has no channel route (its upgrade answered 404 or 405)."""


class Inbox:
    """One request's deltas (or the error that ended it) as the reader delivers them."""

    __slots__ = ("conn", "items", "request_id", "waiter")

    def __init__(self, conn: _Conn, request_id: str) -> None:
        self.conn = conn
        self.request_id = request_id
        self.items: deque[CoreDelta | ReplicaError] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: CoreDelta | ReplicaError) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> CoreDelta:
        """The next delta (raises the error that ended the request). A caller behind the
        reader gets every delta queued meanwhile joined into one (`merge_steps`): the
        layers above it (pool, failover, generation) then handle one delta per batch of
        steps, not one per step."""
        items = self.items
        while not items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item = items.popleft()
        if isinstance(item, ReplicaError):
            raise item
        if not items or not isinstance(items[0], CoreDelta):
            return item
        batch = [item]
        while items and isinstance(items[0], CoreDelta):
            batch.append(cast(CoreDelta, items.popleft()))
        return merge_steps(batch)[0]


class _Conn:
    """One open WebSocket and the requests open on it."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, origin: str) -> None:
        self.ws = ws
        self.origin = origin
        self.inboxes: dict[str, Inbox] = {}
        self.reader: asyncio.Task[None] = asyncio.create_task(self._read())

    async def _read(self) -> None:
        why = "the connection to the replica closed"
        try:
            async for message in self.ws:
                if message.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                    continue
                self._deliver(message.data)
        except ProtocolError as exc:
            why = f"the replica sent a malformed frame: {exc}"
            await self.ws.close()
        except (aiohttp.ClientError, ConnectionError) as exc:
            why = f"the connection to the replica broke: {exc!r}"
        finally:
            self.fail(ReplicaConnectionError(f"{self.origin}: {why}"))

    def _deliver(self, data: bytes) -> None:
        frame = decode_frame(data)
        inboxes = self.inboxes
        for delta in frame.deltas:
            inbox = inboxes.get(delta.request_id)
            if inbox is not None:  # else its caller left: the abort is on its way
                inbox.put(delta)
        for refusal in frame.refused:
            if (inbox := inboxes.get(refusal.request_id)) is not None:
                inbox.put(refusal_error(refusal.status, refusal.error, refusal.retry_after,
                                        self.origin))
        for failure in frame.failed:
            # The engine's text names the exception that failed its step: the log's.
            logger.error("replica %s failed %s after it began: %s", self.origin,
                         failure.request_id, failure.error.get("message"), extra={
                             "event": "replica_stream_error", "replica": self.origin,
                             "request_id": failure.request_id})
            if (inbox := inboxes.get(failure.request_id)) is not None:
                inbox.put(ReplicaStreamError(STREAM_FAILED_MESSAGE, failure.error.get("code")))

    def fail(self, error: ReplicaError) -> None:
        """End every request open on this connection with `error`."""
        inboxes, self.inboxes = self.inboxes, {}
        for inbox in inboxes.values():
            inbox.put(error)


class MuxLink:
    """A replica's channel as its client uses it: `open` a request, read its `Inbox`,
    `leave` it. `supported` is None until the first connection says."""

    def __init__(self, base_url: str, session: Callable[[], aiohttp.ClientSession],
                 headers: dict[str, str] | None) -> None:
        self.base_url = base_url
        self._session = session
        self._headers = headers
        self.supported: bool | None = None
        self._conn: _Conn | None = None
        self._opening: asyncio.Future[_Conn] | None = None
        self._aborts: set[asyncio.Task[None]] = set()

    async def open(self, request_id: str, op: bytes) -> Inbox:
        """Send a generate message `op` for `request_id`; its inbox. Raises MuxUnsupported,
        ReplicaUnauthorized or ReplicaConnectionError."""
        conn = await self._connect()
        if request_id in conn.inboxes:
            raise ReplicaConnectionError(f"{self.base_url}: {request_id} is already open")
        inbox = conn.inboxes[request_id] = Inbox(conn, request_id)
        try:
            await conn.ws.send_bytes(op)
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
            conn.inboxes.pop(request_id, None)
            raise ReplicaConnectionError(f"{self.base_url}: {exc!r}") from exc
        return inbox

    def leave(self, inbox: Inbox, finished: bool) -> None:
        """The caller is done with `inbox`; unless its request finished, the replica is
        told to abort it."""
        conn = inbox.conn
        if conn.inboxes.get(inbox.request_id) is inbox:
            del conn.inboxes[inbox.request_id]
            if not finished and not conn.ws.closed:
                task = asyncio.get_running_loop().create_task(self._abort(conn, inbox))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)

    async def _abort(self, conn: _Conn, inbox: Inbox) -> None:
        with contextlib.suppress(Exception):
            await conn.ws.send_bytes(abort_op(inbox.request_id))

    async def _connect(self) -> _Conn:
        conn = self._conn
        if conn is not None and not conn.ws.closed:
            return conn
        if self.supported is False:
            raise MuxUnsupported()
        if self._opening is None or self._opening.done():
            self._opening = asyncio.ensure_future(self._handshake())
        return await asyncio.shield(self._opening)

    async def _handshake(self) -> _Conn:
        try:
            ws = await self._session().ws_connect(
                self.base_url + MUX_PATH, headers=self._headers, max_msg_size=0,
                compress=0, autoping=True)
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in (404, 405):
                self.supported = False
                raise MuxUnsupported() from exc
            error = {"message": exc.message, "param": None, "code": None}
            raise refusal_error(exc.status, error, None, self.base_url) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise ReplicaConnectionError(f"{self.base_url}: {exc}") from exc
        self.supported = True
        self._conn = _Conn(ws, self.base_url)
        return self._conn

    async def close(self) -> None:
        """Close the connection; every request open on it fails."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.fail(ReplicaConnectionError(f"{self.base_url}: the client was closed"))
        await conn.ws.close()
        conn.reader.cancel()
        with contextlib.suppress(BaseException):
            await conn.reader
