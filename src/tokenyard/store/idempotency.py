"""Idempotency-Key records: claim a key atomically, store the response, replay it.

A record is one API key's (`api_key_id`, within its org) and holds the route it was first
sent to: the same Idempotency-Key from another key of the org is another record, and on
another route it is a 'mismatch' like another body. The claim is an INSERT on the
(org_id, api_key_id, key) primary key: of two racing requests the database lets exactly
one insert, and the other sees the winner's row. An expired record,
or a 'running' one whose request has held it past the lease (its gateway crashed), counts
as absent and is replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from tokenyard.store.records import IdemOutcome, IdempotencyRecord
from tokenyard.store.tables import idempotency_records as records

DEFAULT_TTL_S = 86_400.0  # how long a response stays replayable
DEFAULT_RUNNING_LEASE_S = 900.0  # longer than any request may run
#: Where a running claim keeps its owner (the headers column is empty until it is done).
OWNER = "x-tokenyard-claim-owner"
MAX_ATTEMPTS = 5  # insert / read rounds before giving up (a row deleted under us)


async def begin(
    engine: AsyncEngine,
    now: datetime,
    org_id: str,
    key: str,
    body_hash: str,
    ttl_s: float = DEFAULT_TTL_S,
    running_lease_s: float = DEFAULT_RUNNING_LEASE_S,
    owner: str | None = None,
    owner_is_dead: Callable[[str], bool] | None = None,
    *,
    api_key_id: str = "",
    route: str = "",
) -> tuple[IdemOutcome, IdempotencyRecord | None]:
    """Claim `key` of the API key `api_key_id` for a request to `route` whose body hashes
    to `body_hash` (SHA-256 hex).

    `owner` names the claiming process (kept with the claim while it runs); a running
    claim whose owner `owner_is_dead` says is gone (a gateway worker killed mid-request)
    is taken over at once instead of answering 409 until its lease runs out.

    Returns ('new', None): the caller runs the request, then `complete` or `release`;
    ('replay', record): a response is stored for the same body; ('running', record): the
    same key is in flight; ('mismatch', record): the key was used with another body or
    on another route (`record.route` tells which).
    """
    stale = or_(
        records.c.expires_at <= now,
        and_(
            records.c.state == "running",
            records.c.created_at <= now - timedelta(seconds=running_lease_s),
        ),
    )
    row = {
        "org_id": org_id,
        "api_key_id": api_key_id,
        "key": key,
        "route": route,
        "body_hash": body_hash,
        "state": "running",
        "headers": None if owner is None else {OWNER: owner},
        "created_at": now,
        "expires_at": now + timedelta(seconds=ttl_s),
    }
    this_key = _this_key(org_id, api_key_id, key)
    for _ in range(MAX_ATTEMPTS):
        try:
            # Delete-if-stale first: the transaction starts with a write, so SQLite takes
            # its write lock at once, and a dead record never blocks the insert.
            async with engine.begin() as conn:
                await conn.execute(delete(records).where(this_key, stale))
                await conn.execute(records.insert().values(row))
            return "new", None
        except IntegrityError:
            pass  # someone holds the key: read what they left
        async with engine.connect() as conn:
            found = (await conn.execute(select(records).where(this_key))).mappings().first()
        if found is None:
            continue  # released between our insert and our read: try to claim it again
        record = _record(found)
        if record.body_hash != body_hash or record.route != route:
            return "mismatch", record
        holder = record.headers.get(OWNER) if record.state == "running" else None
        if holder is not None and owner_is_dead is not None and owner_is_dead(holder):
            async with engine.begin() as conn:  # only that claim: not one made since
                await conn.execute(delete(records).where(
                    this_key, records.c.state == "running",
                    records.c.created_at == record.created_at))
            continue
        return ("running" if record.state == "running" else "replay"), record
    raise RuntimeError(f"idempotency key {key!r} kept changing under {MAX_ATTEMPTS} attempts")


async def complete(
    engine: AsyncEngine,
    org_id: str,
    key: str,
    status: int,
    headers: dict[str, str],
    body: bytes,
    *,
    api_key_id: str = "",
) -> bool:
    """Store the response (status code, headers, body bytes) of the request holding `key`.

    False if the claim is gone (released, or replaced after its lease ran out).
    """
    query = (
        update(records)
        .where(_this_key(org_id, api_key_id, key), records.c.state == "running")
        .values(state="done", status_code=status, headers=dict(headers), body=body)
    )
    async with engine.begin() as conn:
        return (await conn.execute(query)).rowcount == 1


async def release(engine: AsyncEngine, org_id: str, key: str, *, api_key_id: str = "") -> bool:
    """Delete a 'running' claim (the request failed), so that a retry runs it anew."""
    query = delete(records).where(_this_key(org_id, api_key_id, key), records.c.state == "running")
    async with engine.begin() as conn:
        return (await conn.execute(query)).rowcount == 1


def _this_key(org_id: str, api_key_id: str, key: str) -> Any:
    """The one record of Idempotency-Key `key` of API key `api_key_id` (of `org_id`)."""
    return and_(records.c.org_id == org_id, records.c.api_key_id == api_key_id,
                records.c.key == key)


def _record(row: Any) -> IdempotencyRecord:
    return IdempotencyRecord(
        org_id=row["org_id"],
        key=row["key"],
        body_hash=row["body_hash"],
        state=row["state"],
        status_code=row["status_code"],
        headers=dict(row["headers"] or {}),
        body=None if row["body"] is None else bytes(row["body"]),
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        api_key_id=row["api_key_id"],
        route=row["route"],
    )
