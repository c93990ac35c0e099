"""The replica's end of the multiplexed channel (`wire/mux.py`): one WebSocket per gateway
process carries all its requests, and each engine step's outputs of all of them go back
in one frame.

The step thread hands a step's outputs to this connection's loop once (a `CoreChannel`);
encoding them (JSON) and writing happen here, on the HTTP thread, never on the step
thread. The writer sends what accumulated since its last write: one frame per step while
the gateway keeps up, several steps in one when it does not (a request's outputs of those
steps joined into one delta, `wire.outputs.merge_steps`). A request is admitted by the
same checks as ``POST /v1/engine/generate`` (`ReplicaServer.prepare`, `.start`); a
disconnect aborts every request of the connection before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from aiohttp import WSMsgType, web

from tokenyard.engine.async_core import AsyncEngineCore
from tokenyard.engine.core import EngineCoreOutput
from tokenyard.engine.core_channel import CoreChannel
from tokenyard.engine.refusal import Refused
from tokenyard.engine.replica_spans import ReplicaSpans
from tokenyard.engine.request import Request
from tokenyard.telemetry.tracing import TRACEPARENT
from tokenyard.wire.mux import ABORT_OP, Failure, Refusal, encode_frame, read_op
from tokenyard.wire.outputs import merge_steps
from tokenyard.wire.protocol import ENGINE_ERROR, INVALID_REQUEST, ProtocolError

log = logging.getLogger("tokenyard.engine")
#: The largest message the gateway may send (a 128k-token prompt is about 1 MiB).
MAX_MESSAGE_BYTES = 16 * 2**20


class ReplicaServer(Protocol):
    """What the channel needs of the replica server (`engine/server.py`): its admission
    (the generate route's) and its count of requests in flight (the drain waits on it)."""

    engine: AsyncEngineCore

    async def prepare(self, body: Any) -> Request: ...

    async def start(self, request: Request, into: Any = None) -> Any: ...

    def ended(self, request_id: str) -> None: ...


async def serve_mux(server: ReplicaServer, http: web.Request) -> web.WebSocketResponse:
    """Serve one gateway's channel until it disconnects; then abort what it left."""
    ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES, compress=False)
    await ws.prepare(http)
    link = _Link(server, ws)
    try:
        async for message in ws:
            if message.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                link.receive(message.data)
    finally:
        await link.close()
    return ws


class _Link:
    """One connection's requests: admissions in flight, open requests, the outbox."""

    def __init__(self, server: ReplicaServer, ws: web.WebSocketResponse) -> None:
        self.server = server
        self.ws = ws
        self.channel = CoreChannel(server.engine, self._on_step, self._on_failure)
        #: Admitted (or being admitted) requests not finished yet, and their spans.
        self.open: dict[str, ReplicaSpans | None] = {}
        self.aborted: set[str] = set()  # aborted while their admission was in progress
        self.outbox: list[EngineCoreOutput] = []
        self.refused: list[Refusal] = []
        self.failed: list[Failure] = []
        #: Requests whose last output or failure is in the outbox: they end once it is
        #: written (a drain waits for that), with their error for the span.
        self.ending: list[tuple[str, str | None]] = []
        self.ready = asyncio.Event()
        self.admissions: set[asyncio.Task[None]] = set()
        self.writer = asyncio.create_task(self._write())

    def receive(self, data: bytes | str) -> None:
        try:
            op, message = read_op(data)
        except ProtocolError as exc:  # a gateway of another version; nothing to answer to
            log.warning("replica channel: %s", exc)
            return
        if op == ABORT_OP:
            request_id = message["request_id"]
            if request_id in self.open:
                self.server.engine.abort(request_id)  # its last output says "abort"
                self.aborted.add(request_id)
            return
        task = asyncio.create_task(self._admit(message))
        self.admissions.add(task)
        task.add_done_callback(self.admissions.discard)

    async def _admit(self, message: dict[str, Any]) -> None:
        body = message.get("request")
        request_id = body.get("request_id") if isinstance(body, dict) else None
        if not isinstance(request_id, str) or not request_id or request_id in self.open:
            self._refuse(str(request_id or ""), Refused(400, "request_id is missing or "
                         "already open on this channel", INVALID_REQUEST, "request_id"))
            return
        traceparent = message.get("traceparent")
        headers = {TRACEPARENT: traceparent} if isinstance(traceparent, str) else {}
        self.open[request_id] = ReplicaSpans.start(headers, request_id)  # None unless traced
        try:
            request = await self.server.prepare(body)
            if request_id in self.aborted:  # the caller left during the grammar's compile
                raise Refused(400, "aborted before it began", INVALID_REQUEST)
            await self.server.start(request, into=self.channel)
        except Refused as refused:
            self.open.pop(request_id, None)
            self.aborted.discard(request_id)
            self._refuse(request_id, refused)

    def _refuse(self, request_id: str, refused: Refused) -> None:
        self.refused.append(Refusal(request_id, refused.status, refused.body()["error"],
                                    refused.retry_after))
        self.ready.set()

    def _on_step(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            spans = self.open.get(out.request_id)
            if spans is not None:
                spans.saw((out,))
            if out.finish_reason is not None:
                self.ending.append((out.request_id, None))
        self.outbox.extend(outputs)
        self.ready.set()

    def _on_failure(self, exc: BaseException) -> None:
        message = f"engine step failed: {exc}"
        for request_id in list(self.open):
            self.failed.append(Failure(request_id, {"message": message, "code": ENGINE_ERROR}))
            self.ending.append((request_id, message))
        self.ready.set()

    def _end(self, request_id: str, error: str | None) -> None:
        spans = self.open.pop(request_id, None)
        self.aborted.discard(request_id)
        if spans is not None:
            spans.export(error)
        self.server.ended(request_id)

    async def _write(self) -> None:
        """Send what accumulated since the last write, in one frame, whenever there is any
        (a slow reader gets several steps per frame)."""
        ws = self.ws
        while True:
            await self.ready.wait()
            self.ready.clear()
            outputs, refused, failed = self.outbox, self.refused, self.failed
            ending = self.ending
            self.outbox, self.refused, self.failed, self.ending = [], [], [], []
            # Steps that queued meanwhile: one delta per request, not one per step.
            frame = encode_frame(((o.request_id, o) for o in merge_steps(outputs)),
                                 refused, failed)
            try:
                await ws.send_bytes(frame)
            except (ConnectionError, RuntimeError):  # the gateway left: the reader ends too
                return
            for request_id, error in ending:
                self._end(request_id, error)

    async def close(self) -> None:
        """The connection ended: abort every request of it; nothing more is written."""
        self.channel.close()
        for task in (self.writer, *self.admissions):
            task.cancel()
        for task in (self.writer, *self.admissions):
            with contextlib.suppress(BaseException):
                await task
        for request_id in list(self.open):
            self._end(request_id, "the gateway's connection closed")

