"""Request records, body captures and the orgs that capture, in the store.

`request_records` holds one row per finished request that reached a deployment (written
in batches by the gateway's recorder, never on the request path); `request_captures` the redacted
bodies of the requests of orgs listed in `org_capture`. Both are purged by age: records
after the serve's retention window, captures at their own `expires_at` (set from the
org's retention days when written). A row is written once: a replayed or duplicated
request id keeps the first row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, insert, select

from tokenyard.store.db import Database
from tokenyard.store.sql import insert_for, utcnow
from tokenyard.store.tables import org_capture, request_captures, request_records


@dataclass(frozen=True)
class RequestRecord:
    """One finished request: whose, where it ran, how it ended, what it used and cost."""

    request_id: str
    created_at: datetime
    org_id: str | None
    project_id: str | None
    key_prefix: str | None
    endpoint: str  # the path, e.g. /v1/chat/completions
    model: str | None  # the name the client asked for
    deployment: str | None
    replica: str | None
    status: int  # HTTP (499: the client went away)
    error_code: str | None
    finish_reason: str | None  # each completion's, comma-joined
    stream: bool
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    cost_micros: int | None  # None: not billed
    timings: dict[str, float]  # stage → ms
    duration_ms: float
    region: str | None = None  # the serving deployment's (None: it declares none)
    user_id: str | None = None  # the key's user (None: a key of no user)
    #: A request with fallbacks: each candidate tried, {model, deployment, outcome,
    #: error_code}, in order (None: a request without).
    attempts: list[dict[str, Any]] | None = None
    #: Where it came from: "live", "batch" (a Batch API line) or "background" (a
    #: background response).
    lane: str = "live"


@dataclass(frozen=True)
class Capture:
    """One request's redacted bodies (text), kept until `expires_at`."""

    request_id: str
    org_id: str
    created_at: datetime
    expires_at: datetime
    request: str
    response: str | None
    truncated: bool


async def insert_requests(
    db: Database, records: Sequence[RequestRecord], captures: Sequence[Capture] = (),
) -> None:
    """Write `records` and `captures` in one transaction; ids already stored are skipped."""
    if not records and not captures:
        return
    async with db.engine.begin() as conn:
        for table, rows in ((request_records, records), (request_captures, captures)):
            if rows:
                await conn.execute(
                    insert_for(conn.dialect.name, table).on_conflict_do_nothing(
                        index_elements=["request_id"]),
                    # A shallow copy of each row's fields (asdict copies deeply: ~10x the
                    # time for what is only read here).
                    [dict(vars(row)) for row in rows])


async def find_request(
    db: Database, request_id: str,
) -> tuple[RequestRecord | None, Capture | None]:
    """The request's record and its capture (each None when absent or purged)."""
    async with db.engine.connect() as conn:
        row = (await conn.execute(select(request_records).where(
            request_records.c.request_id == request_id))).mappings().first()
        captured = (await conn.execute(select(request_captures).where(
            request_captures.c.request_id == request_id,
            request_captures.c.expires_at > utcnow()))).mappings().first()
    return (RequestRecord(**row) if row is not None else None,
            Capture(**captured) if captured is not None else None)


async def list_requests(
    db: Database, *, lane: str | None = None, org_id: str | None = None, limit: int = 100,
) -> list[RequestRecord]:
    """The latest records first (at most `limit`), optionally of one lane or one org."""
    t = request_records.c
    query = select(request_records).order_by(t.created_at.desc()).limit(limit)
    if lane is not None:
        query = query.where(t.lane == lane)
    if org_id is not None:
        query = query.where(t.org_id == org_id)
    async with db.engine.connect() as conn:
        return [RequestRecord(**row) for row in (await conn.execute(query)).mappings()]


async def purge_requests(db: Database, records_before: datetime) -> tuple[int, int]:
    """Delete records created before `records_before` and captures past their expiry:
    (records deleted, captures deleted)."""
    async with db.engine.begin() as conn:
        records = await conn.execute(
            delete(request_records).where(request_records.c.created_at < records_before))
        captures = await conn.execute(
            delete(request_captures).where(request_captures.c.expires_at <= utcnow()))
    return records.rowcount or 0, captures.rowcount or 0


async def capture_settings(db: Database) -> dict[str, int]:
    """Every capturing org: org id → retention days."""
    t = org_capture.c
    async with db.engine.connect() as conn:
        rows = (await conn.execute(select(t.org_id, t.retention_days))).all()
    return {row[0]: int(row[1]) for row in rows}


async def set_capture(db: Database, org_id: str, retention_days: int | None) -> None:
    """Capture the org's bodies for `retention_days` (None: stop capturing)."""
    async with db.engine.begin() as conn:
        await conn.execute(delete(org_capture).where(org_capture.c.org_id == org_id))
        if retention_days is not None:
            await conn.execute(insert(org_capture), [{
                "org_id": org_id, "retention_days": retention_days, "updated_at": utcnow()}])

