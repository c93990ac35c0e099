"""Exact limits across the HTTP workers of one host without Redis: one `InProcessLimiter`
in the parent process, reached by every worker over a Unix socket.

`tokenyard serve --workers N` without a Redis URL runs a `LimitServer` in its parent
process; each worker's gateway uses a `SocketLimiter` (the `Limiter` protocol) connected
to it. Every check-and-take happens in that one limiter, on the parent's single event
loop, so the buckets are exactly those of one process, whatever worker a request reaches.

Framing: one JSON object per line, each way. A worker keeps one connection and may have
many calls in flight on it; a reply carries its call's `id`.

    → {"id": 7, "op": "admit", "tokens": 42, "requests": 1,
       "subjects": [[scope, id, rpm, tpm, conc], …]}
    ← {"id": 7, "lease": "1f", "state": [6 header fields]}
    ← {"id": 7, "refused": [scope, id, kind, limit, used, requested, retry_after],
       "state": [6 header fields]}
    → {"id": 8, "op": "settle", "lease": "1f", "tokens": 30}
    ← {"id": 8}
    ← {"id": 9, "error": "message"}            (a malformed call)

A worker that goes away (a crash, SIGKILL) leaves leases behind: the server settles every
lease its connection still holds with the whole reservation, so the concurrency slots come
back at once and the token buckets keep what was reserved (as `RedisLimiter` does after
its lease ttl). A parent that goes away makes every call fail with `LimiterUnavailable`,
which the gateway answers as it answers a Redis outage: 503 with `retry-after`.

The same connection carries the workers' money holds (`money_*` calls) when the server
has a `MemoryMoney` (gateway/money_server.py): a worker that goes away releases those too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenyard.gateway.limits import (
    Admission,
    InProcessLimiter,
    RateLimited,
    RateLimitState,
    Subject,
    check_amounts,
)
from tokenyard.gateway.money_server import MemoryMoney
from tokenyard.store.records import Limits

logger = logging.getLogger("tokenyard.limit_server")

#: Longest line either side accepts (a call names two subjects: well under this).
MAX_LINE = 64 * 1024
#: How long a worker waits for the parent's answer before the call fails (503).
CALL_TIMEOUT_S = 5.0


class LimiterUnavailable(ConnectionError):
    """The parent's limiter cannot be reached (the gateway answers 503)."""


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"


def _subject_row(subject: Subject) -> list[Any]:
    limits = subject.limits
    return [subject.scope, subject.id, limits.rpm, limits.tpm, limits.max_concurrency]


def _subject(row: Sequence[Any]) -> Subject:
    scope, sid, rpm, tpm, conc = row
    return Subject(str(scope), str(sid), Limits(rpm, tpm, conc))


class LimitServer:
    """The one limiter of a host's workers, served on a Unix socket at `path`."""

    def __init__(self, path: str | Path, limiter: InProcessLimiter | None = None,
                 money: MemoryMoney | None = None) -> None:
        """`money`: the workers' money accounts too (`money_*` calls), when given."""
        self.path = Path(path)
        self.limiter = limiter if limiter is not None else InProcessLimiter()
        self.money = money
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        """Listen at `path` (a stale socket file there is replaced), readable and writable
        by this user only."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = await asyncio.start_unix_server(self._serve, self.path, limit=MAX_LINE)
        self.path.chmod(0o600)

    @property
    def clients(self) -> int:
        """Connections open now (one per live worker)."""
        return len(self._connections)

    async def close(self) -> None:
        """Stop listening and drop every connection (their leases are settled)."""
        if self._server is not None:
            self._server.close()
            for writer in self._connections.values():
                writer.close()  # its handler reads the end and settles what it held
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        leases: dict[str, Admission] = {}
        holds: set[str] = set()  # its money holds
        try:
            while line := await reader.readline():
                writer.write(_dumps(self._answer(line, leases, holds)))
                # Replies are small: only wait when the worker stops reading.
                if writer.transport.get_write_buffer_size() > MAX_LINE:
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # a worker that died mid-line; ValueError: a line over MAX_LINE
        finally:
            self._connections.pop(task, None)
            for admission in leases.values():  # the worker is gone: free its slots
                self.limiter.settle_now(admission, admission.tokens)
            if leases:
                logger.warning("limit server: a worker left %d leases; released",
                               len(leases))
            if self.money is not None:
                self.money.drop(holds)
            writer.close()

    def _answer(self, line: bytes, leases: dict[str, Admission],
                holds: set[str]) -> dict[str, Any]:
        call_id: Any = None
        try:
            call = json.loads(line)
            call_id = call["id"]
            if self.money is not None and str(call["op"]).startswith("money_"):
                return {"id": call_id, **self.money.answer(call, holds)}
            if call["op"] == "admit":
                subjects = [_subject(row) for row in call["subjects"]]
                try:
                    admission = self.limiter.admit_now(subjects, int(call["tokens"]),
                                                       int(call.get("requests", 1)))
                except RateLimited as refusal:
                    return {"id": call_id, "state": list(refusal.state), "refused": [
                        refusal.scope, refusal.subject_id, refusal.kind, refusal.limit,
                        refusal.used, refusal.requested, refusal.retry_after]}
                leases[admission.lease_id] = admission
                return {"id": call_id, "lease": admission.lease_id,
                        "state": list(admission.state)}
            if call["op"] == "settle":
                held = leases.pop(str(call["lease"]), None)
                if held is not None:
                    self.limiter.settle_now(held, int(call["tokens"]))
                return {"id": call_id}
            return {"id": call_id, "error": f"unknown op {call['op']!r}"}
        except (KeyError, TypeError, ValueError) as exc:
            return {"id": call_id, "error": f"malformed call: {exc!r}"}


class _Connection:
    """One connection to the server and the calls waiting for their reply on it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.reading = asyncio.create_task(self._read(reader))

    @property
    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reading.done()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        error = LimiterUnavailable("the parent's limiter closed the connection")
        try:
            while line := await reader.readline():
                reply = json.loads(line)
                future = self.pending.pop(reply.get("id"), None)
                if future is not None and not future.done():
                    future.set_result(reply)
        except (ConnectionError, ValueError) as exc:
            error = LimiterUnavailable(f"the parent's limiter connection broke: {exc}")
        finally:
            self.writer.close()
            for future in self.pending.values():
                if not future.done():
                    future.set_exception(error)
            self.pending.clear()

    async def close(self) -> None:
        self.writer.close()
        self.reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reading


class SocketLimiter:
    """The `Limiter` of one worker: every call goes to the parent's `LimitServer`.

    One connection, opened on first use and again after it broke; calls are pipelined on
    it. Any failure to reach the server raises `LimiterUnavailable`."""

    def __init__(self, path: str | Path, timeout: float = CALL_TIMEOUT_S) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._conn: _Connection | None = None
        self._connecting = asyncio.Lock()
        self._next_id = 0

    async def admit(self, subjects: Sequence[Subject], tokens: int,
                    requests: int = 1) -> Admission:
        """Take `requests`, `tokens` and one slot from every subject in the parent's
        limiter, or raise `RateLimited` (or `LimiterUnavailable`) and take nothing."""
        check_amounts(tokens, requests)
        subjects = tuple(subjects)
        reply = await self.call({"op": "admit", "tokens": tokens, "requests": requests,
                                  "subjects": [_subject_row(s) for s in subjects]})
        state = RateLimitState(*reply["state"])
        refused = reply.get("refused")
        if refused is not None:
            scope, sid, kind, limit, used, requested, retry_after = refused
            raise RateLimited(scope, sid, kind, limit, used, requested, retry_after, state)
        return Admission(reply["lease"], subjects, tokens, state)

    async def settle(self, admission: Admission, actual_tokens: int) -> None:
        """Settle in the parent's limiter; a second settle of the same admission does
        nothing. If the parent is gone, so are its buckets: nothing to give back."""
        if admission.settled:
            return
        admission.settled = True
        await self.call({"op": "settle", "lease": admission.lease_id,
                          "tokens": actual_tokens})

    async def close(self) -> None:
        """Close the connection (the server settles any lease still held)."""
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def call(self, call: dict[str, Any]) -> dict[str, Any]:
        conn = await self._connection()
        self._next_id += 1
        call_id = call["id"] = self._next_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.pending[call_id] = future
        try:
            conn.writer.write(_dumps(call))
            async with asyncio.timeout(self.timeout):
                reply = await future
        except TimeoutError:
            raise LimiterUnavailable("the parent's limiter did not answer in time") from None
        finally:
            conn.pending.pop(call_id, None)
        if "error" in reply:
            raise LimiterUnavailable(f"the parent's limiter refused the call: "
                                     f"{reply['error']}")
        return reply

    async def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None and conn.usable:
            return conn
        async with self._connecting:
            if self._conn is not None and self._conn.usable:
                return self._conn
            try:
                reader, writer = await asyncio.open_unix_connection(self.path, limit=MAX_LINE)
            except OSError as exc:
                raise LimiterUnavailable(
                    f"the parent's limiter is unreachable at {self.path}: {exc}") from None
            self._conn = _Connection(reader, writer)
            return self._conn
