"""Stored responses in the store: one INSERT per response, lookups by id, the chain of
`previous_response_id` links read in one recursive query, and the purge of expired rows.

Every read takes `org_id` (None: any org, for admin keys) and `now`: a row of another org
or past its `expires_at` is treated exactly like a missing one, whether or not the purge
has removed it yet.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, FromClause, Integer, delete, insert, literal, select

from tokenyard.store.db import Database
from tokenyard.store.tables import stored_responses


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: the object the client received and its turn's input items."""

    id: str
    org_id: str
    project_id: str | None
    key_id: str | None
    previous_response_id: str | None
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    created_at: datetime
    expires_at: datetime


def _visible(table: FromClause, now: datetime, org_id: str | None) -> ColumnElement[bool]:
    """Rows still served at `now`, of `org_id` unless it is None."""
    alive = table.c.expires_at > now
    return alive if org_id is None else alive & (table.c.org_id == org_id)


def _record(row: Any) -> StoredResponse:
    return StoredResponse(**{name: row[name] for name in StoredResponse.__dataclass_fields__})


async def insert_response(db: Database, record: StoredResponse) -> None:
    """Write one response (its id must be new)."""
    async with db.engine.begin() as conn:
        await conn.execute(insert(stored_responses), [asdict(record)])


async def get_response(
    db: Database, response_id: str, *, now: datetime, org_id: str | None,
) -> StoredResponse | None:
    """The response `response_id` if `org_id` may see it at `now`."""
    t = stored_responses
    query = select(t).where(t.c.id == response_id, _visible(t, now, org_id))
    async with db.engine.connect() as conn:
        row = (await conn.execute(query)).mappings().first()
    return None if row is None else _record(row)


async def delete_response(
    db: Database, response_id: str, *, now: datetime, org_id: str | None,
) -> bool:
    """Delete `response_id`; False if `org_id` could not see it at `now`."""
    t = stored_responses
    query = delete(t).where(t.c.id == response_id, _visible(t, now, org_id))
    async with db.engine.begin() as conn:
        return (await conn.execute(query)).rowcount == 1


async def response_chain(
    db: Database, response_id: str, *, now: datetime, org_id: str | None, limit: int,
) -> list[StoredResponse]:
    """`response_id` and the responses it continues, newest first, at most `limit` of
    them: the walk stops at the first link `org_id` cannot see at `now` (the caller tells
    a finished chain from a broken one by the last row's `previous_response_id`)."""
    t = stored_responses
    head = (select(t.c.id, t.c.previous_response_id, literal(1, Integer).label("depth"))
            .where(t.c.id == response_id, _visible(t, now, org_id))
            .cte("chain", recursive=True))
    older = t.alias("older")
    chain = head.union_all(
        select(older.c.id, older.c.previous_response_id, head.c.depth + 1)
        .where(older.c.id == head.c.previous_response_id, head.c.depth < limit,
               _visible(older, now, org_id))
    )
    query = select(t).join(chain, t.c.id == chain.c.id).order_by(chain.c.depth)
    async with db.engine.connect() as conn:
        rows = (await conn.execute(query)).mappings().all()
    return [_record(row) for row in rows]


async def purge_expired(db: Database, now: datetime) -> int:
    """Delete every response past its `expires_at`; how many went."""
    t = stored_responses
    async with db.engine.begin() as conn:
        return (await conn.execute(delete(t).where(t.c.expires_at <= now))).rowcount
