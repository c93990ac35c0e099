"""Request records and body capture, kept off the request path.

`RequestLog.observe` takes each finished request's `RequestSummary` (it is a
`telemetry.request_log` observer) and `capture` the bodies of a request whose org
captures them; both only queue. A background task writes what queued in one transaction
every `flush_s`, redacting the captured bodies first (in a thread: regular expressions
over up to `capture_max_bytes` per body), and a second one purges records older than the
retention window and captures past their expiry, at start and every `purge_interval_s`.

Nothing here reads the database on the request path: which orgs capture is read at start
and again every `refresh_s` in the background (a change made through this process's
admin API applies at once; through another process, within `refresh_s`). The queue is
bounded: a store that is down costs at most `max_pending` entries, then entries are
dropped and counted. `find` serves `GET /v1/requests/{id}`, from the queue first, so a
request can be looked up as soon as its response ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from tokenyard.config import ServeConfig
from tokenyard.gateway.redaction import Redactor
from tokenyard.gateway.regions import require_data_region
from tokenyard.store.money import format_money
from tokenyard.store.records import KeyContext
from tokenyard.store.repo import Store
from tokenyard.store.requests import (
    Capture,
    RequestRecord,
    capture_settings,
    find_request,
    insert_requests,
    list_requests,
    purge_requests,
    set_capture,
)
from tokenyard.store.sql import utcnow
from tokenyard.telemetry.request_log import RequestSummary

logger = logging.getLogger("tokenyard.gateway")

#: Days a capture is kept when the admin does not say.
DEFAULT_CAPTURE_DAYS = 7


def record_of(summary: RequestSummary) -> RequestRecord:
    """The stored record of a finished request."""
    return RequestRecord(
        request_id=summary.request_id,
        created_at=datetime.fromtimestamp(summary.started_at, UTC),
        org_id=summary.org_id, project_id=summary.project_id, user_id=summary.user_id,
        key_prefix=summary.key_prefix, endpoint=summary.path, model=summary.model,
        deployment=summary.deployment, replica=summary.replica, status=summary.status,
        error_code=summary.error_code, finish_reason=summary.finish_reason,
        stream=summary.stream, prompt_tokens=summary.prompt_tokens,
        cached_tokens=summary.cached_tokens, output_tokens=summary.output_tokens,
        cost_micros=None if summary.cost is None else int(summary.cost.scaleb(6)),
        timings=dict(summary.timings_ms), duration_ms=summary.duration_ms,
        region=summary.region,
        attempts=None if summary.attempts is None else list(summary.attempts),
        lane=summary.lane,
    )


def record_json(record: RequestRecord, capture: Capture | None, *,
                internal: bool = False) -> dict[str, Any]:
    """What `GET /v1/requests/{id}` answers. `replica` (a replica's URL: an internal
    address) is shown to operators only (`internal`: an admin key); a tenant's own record
    has it null."""
    return {
        "id": record.request_id, "object": "request",
        "created_at": record.created_at.isoformat(),
        "org_id": record.org_id, "project_id": record.project_id, "user_id": record.user_id,
        "key_prefix": record.key_prefix, "endpoint": record.endpoint,
        "model": record.model, "deployment": record.deployment,
        "region": record.region, "replica": record.replica if internal else None,
        "status": record.status, "error_code": record.error_code,
        "finish_reason": record.finish_reason, "stream": record.stream,
        "tokens": {"prompt": record.prompt_tokens, "cached": record.cached_tokens,
                   "output": record.output_tokens},
        "cache_hit": record.cached_tokens > 0,
        "cost": None if record.cost_micros is None else {
            "currency": "USD", "total": format_money(record.cost_micros)},
        "timeline": record.timings, "duration_ms": record.duration_ms,
        "attempts": record.attempts, "lane": record.lane,
        "capture": None if capture is None else {
            "request": _parsed(capture.request), "response": _parsed(capture.response),
            "truncated": capture.truncated, "expires_at": capture.expires_at.isoformat()},
    }


def _parsed(text: str | None) -> Any:
    """A captured body: its JSON when whole, else the (cut) text itself."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


class _Body:
    """A body as captured on the request path: raw bytes (`cut` when sliced there at the
    capture limit) or a JSON-ready value, not yet redacted."""

    __slots__ = ("cut", "raw", "value")

    def __init__(self, raw: bytes | None = None, value: Any = None, cut: bool = False) -> None:
        self.raw, self.value, self.cut = raw, value, cut


#: A capture as queued: org, retention days, request body, response body.
_Bodies = tuple[str, int, _Body, _Body]


class RequestLog:
    """The request records and body captures of one gateway process."""

    def __init__(self, store: Store, config: ServeConfig | None = None, *,
                 flush_s: float = 0.25, refresh_s: float = 5.0,
                 max_pending: int = 10_000, max_captures: int = 1_000) -> None:
        config = config or ServeConfig()
        self.store = store
        self.retention = timedelta(hours=config.request_records_retention_hours)
        self.purge_interval_s = config.request_records_purge_interval_s
        self.capture_max_bytes = config.capture_max_bytes
        self.redactor = Redactor(tuple(config.redact_patterns))
        self.flush_s, self.refresh_s, self.max_pending = flush_s, refresh_s, max_pending
        self.max_captures = max_captures  # bodies of up to capture_max_bytes each
        self.captures: dict[str, int] = {}  # capturing org → retention days
        #: This gateway's region (`serve --region`): an org bound to others reads its
        #: request records and captures elsewhere (403).
        self.region = config.region
        self.dropped = 0
        self._records: dict[str, RequestRecord] = {}
        self._bodies: dict[str, _Bodies] = {}
        # The batch being written: still served by `find` until it is in the store.
        self._writing: tuple[dict[str, RequestRecord], dict[str, _Bodies]] = ({}, {})
        self._wake = asyncio.Event()
        self._flushing = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []

    # -- the request path: queue only ---------------------------------------------------

    def observe(self, summary: RequestSummary) -> None:
        """Queue the record of a finished request that reached a deployment."""
        if summary.deployment is None or summary.org_id is None:
            return  # not a model's request (admin, listings, lookups) or unauthenticated
        if len(self._records) >= self.max_pending:
            self.dropped += 1
            return
        self._records[summary.request_id] = record_of(summary)
        self._wake.set()

    def capturing(self, key: KeyContext | None) -> bool:
        """Whether the bodies of `key`'s requests are captured (its org's setting)."""
        return key is not None and key.org_id in self.captures

    def capture(self, request_id: str, key: KeyContext, request: bytes, response: Any) -> None:
        """Queue a request's raw body (cut at the capture limit) and its response (a
        JSON-ready value: the body the client got, or for a stream the body its deltas
        make) for redaction and storage."""
        days = self.captures.get(key.org_id)
        if days is None:
            return
        if len(self._bodies) >= self.max_captures:
            self.dropped += 1
            return
        cut = len(request) > self.capture_max_bytes
        self._bodies[request_id] = (
            key.org_id, days, _Body(raw=request[: self.capture_max_bytes], cut=cut),
            _Body(value=response))
        self._wake.set()

    # -- lookups and settings -----------------------------------------------------------

    async def find(self, request_id: str, key: KeyContext) -> dict[str, Any] | None:
        """The request's record (and capture) if `key` may see it: a key of its org, or
        an admin key (which alone sees the replica). None otherwise, or when it is unknown
        or purged. 403 on a gateway outside the key's regions."""
        require_data_region(self.region, key.allowed_regions, "request records and captures")
        record = self._records.get(request_id) or self._writing[0].get(request_id)
        body = None
        if record is None:
            record, capture = await find_request(self.store.db, request_id)
        else:
            body = self._bodies.get(request_id) or self._writing[1].get(request_id)
            capture = None
        if record is None or not (key.scopes.admin or key.org_id == record.org_id):
            return None
        if capture is None and body is not None:
            # A queued body is redacted for its reader, after the check, and off the loop.
            capture = await asyncio.to_thread(self._redacted, request_id, *body)
        return record_json(record, capture, internal=key.scopes.admin)

    async def listed(self, *, lane: str | None = None, org_id: str | None = None,
                     limit: int = 100) -> list[dict[str, Any]]:
        """The latest records first, of every org (an admin's view: replicas shown),
        optionally of one lane or org; what is queued here is written first."""
        await self.flush()
        found = await list_requests(self.store.db, lane=lane, org_id=org_id, limit=limit)
        return [record_json(record, None, internal=True) for record in found]

    async def set_capture(self, org_id: str, retention_days: int | None) -> None:
        """Capture the org's bodies for `retention_days` (None: stop); applies here at once."""
        await set_capture(self.store.db, org_id, retention_days)
        if retention_days is None:
            self.captures.pop(org_id, None)
        else:
            self.captures[org_id] = retention_days

    # -- background -----------------------------------------------------------------------

    async def start(self) -> None:
        """Read the capture settings, then start writing, refreshing and purging."""
        await self._refresh()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write_loop()),
                       loop.create_task(self._purge_loop()),
                       loop.create_task(self._refresh_loop())]

    async def close(self) -> None:
        """Stop the background tasks and write what is queued."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._tasks = []
        await self.flush()

    async def flush(self) -> None:
        """Write everything queued now (a failed write is logged and dropped: a record is
        never worth failing or slowing a request for). One batch at a time: the batch
        being written is what `find` serves besides the queue."""
        async with self._flushing:
            records, self._records = self._records, {}
            bodies, self._bodies = self._bodies, {}
            if not records and not bodies:
                return
            self._writing = (records, bodies)
            try:
                captures = await asyncio.to_thread(
                    lambda: [self._redacted(rid, *body) for rid, body in bodies.items()])
                await insert_requests(self.store.db, list(records.values()), captures)
            except Exception as exc:
                logger.warning("dropped %d request records and %d captures: %s",
                               len(records), len(bodies), exc)
            finally:
                self._writing = ({}, {})

    async def purge(self) -> tuple[int, int]:
        """Delete records past the retention window and captures past their expiry."""
        return await purge_requests(self.store.db, utcnow() - self.retention)

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.flush_s)  # let a batch gather
            self._wake.clear()
            # Shielded: `close` cancelling this loop must not drop the batch in flight.
            await asyncio.shield(self.flush())

    async def _purge_loop(self) -> None:
        while True:
            try:
                records, captures = await self.purge()
                if records or captures:
                    logger.info("purged %d request records and %d captures", records,
                                captures)
            except Exception as exc:
                logger.warning("purging request records failed: %s", exc)
            await asyncio.sleep(self.purge_interval_s)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            self.captures = await capture_settings(self.store.db)
        except Exception as exc:
            logger.warning("reading the orgs' capture settings failed: %s", exc)

    # -- redaction ------------------------------------------------------------------------

    def _redacted(self, request_id: str, org_id: str, days: int, request: _Body,
                  response: _Body) -> Capture:
        now = utcnow()
        req, req_cut = self._text(request)
        resp, resp_cut = self._text(response)
        return Capture(request_id=request_id, org_id=org_id, created_at=now,
                       expires_at=now + timedelta(days=days), request=req, response=resp,
                       truncated=req_cut or resp_cut)

    def _text(self, body: _Body) -> tuple[str, bool]:
        """A body redacted, as text: JSON redacted value by value when whole, the text
        cut at the capture limit and redacted as a whole otherwise; and whether it was
        cut."""
        if body.raw is not None:
            try:
                value = json.loads(body.raw)
            except ValueError:
                text, cut = self._cut(body.raw.decode("utf-8", "ignore"))
                return text, cut or body.cut
        else:
            value = body.value
            whole = json.dumps(value, ensure_ascii=False)
            if len(whole) > self.capture_max_bytes:  # cut first: redact what is kept only
                return self._cut(whole)[0], True
        text = json.dumps(self.redactor.json(value), ensure_ascii=False)
        return (text, False) if len(text.encode()) <= self.capture_max_bytes else self._cut(
            text)

    def _cut(self, text: str) -> tuple[str, bool]:
        data = text.encode()
        if len(data) <= self.capture_max_bytes:
            return self.redactor.text(text), False
        return self.redactor.text(
            data[: self.capture_max_bytes].decode("utf-8", "ignore")), True
