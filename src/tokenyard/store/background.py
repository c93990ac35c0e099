"""Background responses in the store: work every gateway process shares, held under a
lease as batch lines are (`store/batches.py`).

A response is `queued`, `running` (claimed by one worker until `lease_until`), `done` or
`cancelled`. `claim` takes the oldest claimable responses of the worker's region in one
statement (`FOR UPDATE SKIP LOCKED` on PostgreSQL, SQLite's single writer otherwise); one
whose worker died is claimable again once its lease is past, and its events after the
queued ones are dropped then, since the new attempt streams its own. `append` and
`finish` write only while the worker still holds the response, renewing its lease in the
same transaction, so a response has one outcome however often it was run; `finish` also
stores it among the stored responses in that transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tokenyard.store.background_tables import background_events, background_responses
from tokenyard.store.db import Database
from tokenyard.store.responses import StoredResponse
from tokenyard.store.tables import stored_responses

#: Events a response has once queued (response.created, response.queued): a new attempt
#: keeps them and streams the rest again.
QUEUED_EVENTS = 2
#: States in which a response still has work.
AT_WORK = ("queued", "running")


@dataclass(frozen=True)
class BackgroundJob:
    """One background response: what a worker needs to run it, and what a reader sees."""

    id: str
    org_id: str
    project_id: str | None
    key_id: str
    region: str | None
    body: str  # the request body, JSON text
    earlier: list[dict[str, Any]]  # the items it continues (previous response, conversation)
    response: dict[str, Any]  # the response object as it stands
    state: str
    attempts: int
    created_at: datetime
    expires_at: datetime


_FIELDS = [background_responses.c[name] for name in BackgroundJob.__dataclass_fields__]


def _job(row: Any) -> BackgroundJob:
    return BackgroundJob(**{name: row[name] for name in BackgroundJob.__dataclass_fields__})


def _visible(now: datetime, org_id: str | None) -> Any:
    t = background_responses
    alive = t.c.expires_at > now
    return alive if org_id is None else alive & (t.c.org_id == org_id)


async def insert_job(db: Database, job: BackgroundJob,
                     events: Sequence[dict[str, Any]]) -> None:
    """A new queued response and its first events."""
    async with db.engine.begin() as conn:
        await conn.execute(insert(background_responses), [asdict(job)])
        await _insert_events(conn, job.id, events)


async def get_job(db: Database, response_id: str, *, now: datetime,
                  org_id: str | None) -> BackgroundJob | None:
    """The response if `org_id` (None: any) may see it at `now`."""
    query = select(*_FIELDS).where(background_responses.c.id == response_id,
                                   _visible(now, org_id))
    async with db.engine.connect() as conn:
        row = (await conn.execute(query)).mappings().first()
    return None if row is None else _job(row)


async def events_after(db: Database, response_id: str, after: int, *, now: datetime,
                       org_id: str | None) -> tuple[str | None, list[dict[str, Any]]]:
    """The response's state (None: not found) and its events after sequence `after`, in
    order. The state is read first: when it is an ended one, the events are all there."""
    t, e = background_responses, background_events
    async with db.engine.connect() as conn:
        state = (await conn.execute(select(t.c.state).where(
            t.c.id == response_id, _visible(now, org_id)))).scalar()
        if state is None:
            return None, []
        rows = (await conn.execute(
            select(e.c.event).where(e.c.response_id == response_id, e.c.sequence > after)
            .order_by(e.c.sequence))).scalars().all()
    return str(state), [dict(row) for row in rows]


async def cancel_job(db: Database, response_id: str, *, now: datetime, org_id: str | None,
                     response: dict[str, Any]) -> bool:
    """End a response still at work as cancelled, with `response` as its object; False
    if it was not at work (or not visible to `org_id`)."""
    t = background_responses
    query = (update(t).where(t.c.id == response_id, _visible(now, org_id),
                             t.c.state.in_(AT_WORK))
             .values(state="cancelled", response=response, ended_at=now,
                     claimed_by=None, lease_until=None))
    async with db.engine.begin() as conn:
        return bool((await conn.execute(query)).rowcount)


async def delete_job(db: Database, response_id: str, *, now: datetime,
                     org_id: str | None) -> bool:
    """Delete the response and its events; False if `org_id` could not see it."""
    t = background_responses
    async with db.engine.begin() as conn:
        gone = (await conn.execute(delete(t).where(
            t.c.id == response_id, _visible(now, org_id)))).rowcount
        if gone:
            await conn.execute(delete(background_events).where(
                background_events.c.response_id == response_id))
    return bool(gone)


def _claimable(now: datetime) -> Any:
    t = background_responses
    return or_(t.c.state == "queued", and_(t.c.state == "running", t.c.lease_until < now))


async def claim(db: Database, worker: str, region: str | None, *, now: datetime,
                lease_s: float, limit: int) -> list[BackgroundJob]:
    """Up to `limit` claimable responses of `region` (None: a gateway without one), oldest
    first, now held by `worker` for `lease_s`. A response claimed again (its worker died)
    loses the events its earlier attempt streamed after the queued ones."""
    t = background_responses
    async with db.engine.begin() as conn:
        ids = (select(t.c.id)
               .where(_claimable(now), t.c.expires_at > now,
                      t.c.region.is_not_distinct_from(region))
               .order_by(t.c.created_at, t.c.id).limit(limit))
        if conn.dialect.name == "postgresql":
            ids = ids.with_for_update(skip_locked=True)
        query = (update(t).where(t.c.id.in_(ids))
                 .values(state="running", claimed_by=worker, attempts=t.c.attempts + 1,
                         lease_until=now + timedelta(seconds=lease_s))
                 .returning(*_FIELDS))
        jobs = sorted((_job(row) for row in (await conn.execute(query)).mappings().all()),
                      key=lambda job: (job.created_at, job.id))
        again = [job.id for job in jobs if job.attempts > 1]
        if again:
            e = background_events
            await conn.execute(delete(e).where(e.c.response_id.in_(again),
                                               e.c.sequence >= QUEUED_EVENTS))
    return jobs


async def renew(db: Database, worker: str, *, now: datetime, lease_s: float) -> int:
    """Extend the leases of the responses `worker` is running."""
    t = background_responses
    query = (update(t).where(t.c.state == "running", t.c.claimed_by == worker)
             .values(lease_until=now + timedelta(seconds=lease_s)))
    async with db.engine.begin() as conn:
        return int((await conn.execute(query)).rowcount)


async def release(db: Database, response_id: str, worker: str) -> None:
    """Give a claimed response back to the queue (refused for now: the limits); the
    claim does not count among its attempts."""
    t = background_responses
    async with db.engine.begin() as conn:
        await conn.execute(update(t).where(
            t.c.id == response_id, t.c.state == "running", t.c.claimed_by == worker,
        ).values(state="queued", claimed_by=None, lease_until=None,
                 attempts=t.c.attempts - 1))


def _held(response_id: str, worker: str) -> Any:
    t = background_responses
    return and_(t.c.id == response_id, t.c.state == "running", t.c.claimed_by == worker)


async def append(db: Database, response_id: str, worker: str,
                 events: Sequence[dict[str, Any]], *, now: datetime, lease_s: float,
                 response: dict[str, Any] | None = None) -> bool:
    """Write `events` and, if given, the response object as it
    stands, renewing the lease; False (nothing written) if `worker` no longer holds the
    response: cancelled, deleted, or taken over after its lease ran out."""
    values: dict[str, Any] = {"lease_until": now + timedelta(seconds=lease_s)}
    if response is not None:
        values["response"] = response
    async with db.engine.begin() as conn:
        held = (await conn.execute(update(background_responses)
                                   .where(_held(response_id, worker)).values(values)))
        if not held.rowcount:
            return False
        await _insert_events(conn, response_id, events)
    return True


async def finish(db: Database, response_id: str, worker: str,
                 events: Sequence[dict[str, Any]], *, now: datetime,
                 response: dict[str, Any], stored: StoredResponse | None) -> bool:
    """End the response `done` with its last `events` and its final object, and store
    it (`stored`, for `previous_response_id` and input_items), in one transaction, if
    `worker` still holds it; False (nothing written) otherwise."""
    async with db.engine.begin() as conn:
        held = await conn.execute(update(background_responses)
                                  .where(_held(response_id, worker))
                                  .values(state="done", response=response, ended_at=now,
                                          lease_until=None))
        if not held.rowcount:
            return False
        await _insert_events(conn, response_id, events)
        if stored is not None:
            await conn.execute(insert(stored_responses), [asdict(stored)])
    return True


async def purge_expired(db: Database, now: datetime) -> int:
    """Delete every response past its `expires_at` and its events; how many went."""
    t, e = background_responses, background_events
    async with db.engine.begin() as conn:
        gone = select(t.c.id).where(t.c.expires_at <= now)
        await conn.execute(delete(e).where(e.c.response_id.in_(gone)))
        return int((await conn.execute(delete(t).where(t.c.expires_at <= now))).rowcount)


async def _insert_events(conn: AsyncConnection, response_id: str,
                         events: Sequence[dict[str, Any]]) -> None:
    """Each event under its own `sequence_number`."""
    if events:
        await conn.execute(insert(background_events), [
            {"response_id": response_id, "sequence": event["sequence_number"],
             "event": event} for event in events])
