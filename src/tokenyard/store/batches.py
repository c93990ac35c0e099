"""Batches and their lines in the store: job state every gateway process shares.

A batch's lines are `queued`, `running` (claimed by one worker until `lease_until`),
`done` (holding their rendered result) or `aborted` (cut in flight by the batch's
cancel). `claim` takes a few claimable lines of one batch in one statement — an UPDATE
whose subquery picks them, with `FOR UPDATE SKIP LOCKED` on PostgreSQL (two gateways
never take the same line), and under SQLite's single writer lock on SQLite — and a line
whose worker died is claimable again once its lease is past. `finish_lines` writes a
group of results, each only while its line is still claimed by that worker, so a line
has exactly one result however often it was run; in the same transaction it adds them to
their batch's row (its counts and usage), so a status read is one row. `finalize` ends
a batch and writes its result files in one transaction, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, insert, or_, select, tuple_, update

from tokenyard.store.db import Database
from tokenyard.store.files import FileRecord, add_file
from tokenyard.store.tables import batch_lines, batches, orgs

#: Statuses in which a batch still has work (and counts against its org's queue quota).
ACTIVE = ("in_progress", "cancelling")


@dataclass(frozen=True)
class BatchRecord:
    id: str
    dialect: str  # openai or anthropic
    org_id: str
    project_id: str | None
    key_id: str
    endpoint: str
    input_file_id: str | None
    completion_window: str
    metadata: dict[str, Any] | None
    status: str
    total: int
    enqueued_tokens: int
    output_file_id: str | None
    error_file_id: str | None
    created_at: datetime
    in_progress_at: datetime | None
    expires_at: datetime
    cancelling_at: datetime | None
    ended_at: datetime | None
    #: The model its lines name (the first line's), and its lines' ends and usage so
    #: far (kept by `finish_lines`).
    model: str | None = None
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def unended(self) -> int:
        """Lines not ended yet (queued or running; at the batch's end: never run)."""
        return self.total - self.succeeded - self.failed - self.cancelled


@dataclass(frozen=True)
class NewLine:
    custom_id: str
    body: str  # the request body, JSON text
    sort_key: str


@dataclass(frozen=True)
class Claimed:
    """A line a worker holds: what it needs to run it."""

    batch_id: str
    line: int
    custom_id: str
    body: str
    endpoint: str
    dialect: str
    key_id: str


@dataclass(frozen=True)
class LineEnd:
    """How a line ended: its status code and rendered result (None for both: aborted by
    the batch's cancel) and the tokens it was billed for."""

    batch_id: str
    line: int
    status_code: int | None
    result: str | None
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def state(self) -> str:
        return "aborted" if self.result is None else "done"

    @property
    def counted(self) -> str:
        """The batch's count it adds to."""
        if self.result is None:
            return "cancelled"
        return "succeeded" if self.status_code == 200 else "failed"


@dataclass(frozen=True)
class LineResult:
    line: int
    custom_id: str
    state: str
    status_code: int | None
    result: str | None


_FIELDS = [batches.c[name] for name in BatchRecord.__dataclass_fields__]
_VISIBLE = batches.c.deleted.is_(False)


async def create_batch(db: Database, record: BatchRecord, lines: Sequence[NewLine]) -> None:
    """The batch and its queued lines, in one transaction."""
    row = {name: getattr(record, name) for name in BatchRecord.__dataclass_fields__}
    rows = [{"batch_id": record.id, "line": i, "custom_id": line.custom_id,
             "body": line.body, "sort_key": line.sort_key, "state": "queued"}
            for i, line in enumerate(lines)]
    async with db.engine.begin() as conn:
        await conn.execute(insert(batches), [row])
        for start in range(0, len(rows), 1000):
            await conn.execute(insert(batch_lines), rows[start:start + 1000])


async def get_batch(db: Database, batch_id: str, org_id: str, dialect: str,
                    ) -> BatchRecord | None:
    """The batch if it is `org_id`'s, of `dialect`, and not deleted."""
    query = select(*_FIELDS).where(batches.c.id == batch_id, batches.c.org_id == org_id,
                                   batches.c.dialect == dialect, _VISIBLE)
    async with db.engine.connect() as conn:
        row = (await conn.execute(query)).mappings().first()
    return None if row is None else BatchRecord(**row)


async def list_batches(db: Database, org_id: str, dialect: str, *, limit: int,
                       after: str | None = None, before: str | None = None,
                       ) -> list[BatchRecord]:
    """`org_id`'s batches of `dialect`, newest first: `limit` of them after the batch
    `after` (or, with `before`, the `limit` newer than it, still newest first)."""
    t = batches
    query = select(*_FIELDS).where(t.c.org_id == org_id, t.c.dialect == dialect, _VISIBLE)
    newer = before is not None and after is None
    cursor = after if after is not None else before
    async with db.engine.connect() as conn:
        if cursor is not None:
            mark = (await conn.execute(select(t.c.created_at, t.c.id).where(
                t.c.id == cursor, t.c.org_id == org_id))).first()
            if mark is not None:
                key = tuple_(t.c.created_at, t.c.id)
                query = query.where(key > tuple_(*mark) if newer else key < tuple_(*mark))
        order = (t.c.created_at.asc(), t.c.id.asc()) if newer else (
            t.c.created_at.desc(), t.c.id.desc())
        rows = (await conn.execute(query.order_by(*order).limit(limit))).mappings().all()
    found = [BatchRecord(**row) for row in rows]
    return found[::-1] if newer else found


async def line_counts(db: Database, batch_id: str) -> dict[str, int]:
    """How many lines are queued, running, succeeded (done with status 200), failed and
    cancelled (aborted), counted from the lines: a check of the counts the batch's row
    keeps (the routes read the row)."""
    t = batch_lines
    ok = (t.c.state == "done") & (t.c.status_code == 200)
    query = (select(t.c.state, ok.label("ok"), func.count())
             .where(t.c.batch_id == batch_id).group_by(t.c.state, ok))
    counts = {"queued": 0, "running": 0, "succeeded": 0, "failed": 0, "cancelled": 0}
    named = {"aborted": "cancelled"}
    async with db.engine.connect() as conn:
        for state, good, n in (await conn.execute(query)).all():
            name = (named.get(state, state) if state != "done"
                    else "succeeded" if good else "failed")
            counts[name] += n
    return counts


async def enqueued_tokens(db: Database, org_id: str) -> tuple[int, int | None]:
    """The estimated tokens of `org_id`'s batches still at work, and the org's own quota
    of them (None: it has none, the gateway's default applies)."""
    held = select(func.coalesce(func.sum(batches.c.enqueued_tokens), 0)).where(
        batches.c.org_id == org_id, batches.c.status.in_(ACTIVE))
    quota = select(orgs.c.batch_enqueued_tokens).where(orgs.c.id == org_id)
    async with db.engine.connect() as conn:
        return (int((await conn.execute(held)).scalar() or 0),
                (await conn.execute(quota)).scalar())


async def cancel_batch(db: Database, batch_id: str, org_id: str, dialect: str,
                       now: datetime) -> bool:
    """Mark an in-progress batch `cancelling` (no new line is claimed from it); False if
    it was not in progress (or not `org_id`'s)."""
    query = (update(batches)
             .where(batches.c.id == batch_id, batches.c.org_id == org_id,
                    batches.c.dialect == dialect, batches.c.status == "in_progress")
             .values(status="cancelling", cancelling_at=now))
    async with db.engine.begin() as conn:
        return bool((await conn.execute(query)).rowcount)


async def delete_batch(db: Database, batch_id: str, org_id: str, dialect: str) -> bool:
    """Hide an ended batch (Anthropic's DELETE); False if it is not ended or not found."""
    query = (update(batches)
             .where(batches.c.id == batch_id, batches.c.org_id == org_id,
                    batches.c.dialect == dialect, _VISIBLE,
                    batches.c.status.not_in(ACTIVE))
             .values(deleted=True))
    async with db.engine.begin() as conn:
        return bool((await conn.execute(query)).rowcount)


def _claimable(now: datetime) -> Any:
    t = batch_lines
    return or_(t.c.state == "queued", and_(t.c.state == "running", t.c.lease_until < now))


async def claim(db: Database, worker: str, *, now: datetime, lease_s: float,
                limit: int) -> list[Claimed]:
    """Up to `limit` claimable lines of the oldest in-progress batch that has any, in
    its order (`sort_key`, then line), now held by `worker` for `lease_s`."""
    t, b = batch_lines, batches
    async with db.engine.begin() as conn:
        pick = (select(b.c.id, b.c.endpoint, b.c.dialect, b.c.key_id)
                .where(b.c.status == "in_progress", b.c.expires_at > now,
                       select(t.c.line).where(t.c.batch_id == b.c.id, _claimable(now))
                       .exists())
                .order_by(b.c.created_at, b.c.id).limit(1))
        chosen = (await conn.execute(pick)).first()
        if chosen is None:
            return []
        batch_id, endpoint, dialect, key_id = chosen
        lines = (select(t.c.batch_id, t.c.line)
                 .where(t.c.batch_id == batch_id, _claimable(now))
                 .order_by(t.c.sort_key, t.c.line).limit(limit))
        if conn.dialect.name == "postgresql":
            lines = lines.with_for_update(skip_locked=True)
        query = (update(t)
                 .where(tuple_(t.c.batch_id, t.c.line).in_(lines))
                 .values(state="running", claimed_by=worker,
                         lease_until=now + timedelta(seconds=lease_s))
                 .returning(t.c.line, t.c.custom_id, t.c.body, t.c.sort_key))
        rows = sorted((await conn.execute(query)).all(), key=lambda r: (r[3], r[0]))
    return [Claimed(batch_id, line, custom_id, body, endpoint, dialect, key_id)
            for line, custom_id, body, _ in rows]


async def renew(db: Database, worker: str, *, now: datetime, lease_s: float) -> int:
    """Extend the leases of the lines `worker` is running."""
    t = batch_lines
    query = (update(t).where(t.c.state == "running", t.c.claimed_by == worker)
             .values(lease_until=now + timedelta(seconds=lease_s)))
    async with db.engine.begin() as conn:
        return int((await conn.execute(query)).rowcount)


async def finish_lines(db: Database, worker: str, ends: Sequence[LineEnd], *,
                       now: datetime) -> list[LineEnd]:
    """Write a group of lines' ends in one transaction, each only if `worker` still holds
    its line, and add them to their batches' counts; returns those written (a line
    another worker took over, its lease past, or one done already keeps its one result)."""
    t, b = batch_lines, batches
    written: list[LineEnd] = []
    async with db.engine.begin() as conn:
        for end in ends:
            query = (update(t)
                     .where(t.c.batch_id == end.batch_id, t.c.line == end.line,
                            t.c.state == "running", t.c.claimed_by == worker)
                     .values(state=end.state, status_code=end.status_code,
                             result=end.result, finished_at=now, lease_until=None))
            if (await conn.execute(query)).rowcount:
                written.append(end)
        sums: dict[str, dict[str, int]] = {}
        for end in written:
            add = sums.setdefault(end.batch_id, dict.fromkeys(_COUNTED, 0))
            add[end.counted] += 1
            add["input_tokens"] += end.input_tokens
            add["cached_tokens"] += end.cached_tokens
            add["output_tokens"] += end.output_tokens
        for batch_id, add in sums.items():
            await conn.execute(update(b).where(b.c.id == batch_id).values(
                {name: b.c[name] + n for name, n in add.items() if n}))
    return written


_COUNTED = ("succeeded", "failed", "cancelled", "input_tokens", "cached_tokens",
            "output_tokens")


async def finish_line(db: Database, batch_id: str, line: int, worker: str, *,
                      status_code: int, result: str, now: datetime) -> bool:
    """`finish_lines` of one line: False if it was not written."""
    end = LineEnd(batch_id, line, status_code, result)
    return bool(await finish_lines(db, worker, [end], now=now))


async def statuses(db: Database, batch_ids: Sequence[str]) -> dict[str, str]:
    """The status of each of `batch_ids` (a worker's look for cancels of what it runs)."""
    query = select(batches.c.id, batches.c.status).where(batches.c.id.in_(batch_ids))
    async with db.engine.connect() as conn:
        return {batch_id: status for batch_id, status in (await conn.execute(query)).all()}


async def release(db: Database, batch_id: str, line: int, worker: str) -> None:
    """Give a claimed line back to the queue (its worker stops before running it)."""
    t = batch_lines
    async with db.engine.begin() as conn:
        await conn.execute(update(t).where(
            t.c.batch_id == batch_id, t.c.line == line, t.c.state == "running",
            t.c.claimed_by == worker).values(state="queued", claimed_by=None,
                                             lease_until=None))


async def due(db: Database, now: datetime) -> list[tuple[BatchRecord, str]]:
    """Batches ready to end, each with the status it ends in: in progress with every
    line ended (completed: the counts on its row say so) or past its window (expired);
    cancelling with no line running under a live lease (cancelled). A line whose lease
    ran out (its worker died) is still to run: another worker claims it, so it keeps an
    in-progress batch open."""
    t, b = batch_lines, batches
    running = select(t.c.line).where(t.c.batch_id == b.c.id, t.c.state == "running",
                                     t.c.lease_until >= now)
    ended = b.c.succeeded + b.c.failed + b.c.cancelled
    query = select(*_FIELDS).where(or_(
        and_(b.c.status == "in_progress", or_(ended >= b.c.total, b.c.expires_at <= now)),
        and_(b.c.status == "cancelling", ~running.exists())))
    async with db.engine.connect() as conn:
        rows = (await conn.execute(query)).mappings().all()
    out = []
    for row in rows:
        record = BatchRecord(**row)
        if record.status == "cancelling":
            out.append((record, "cancelled"))
        else:
            out.append((record, "expired" if record.expires_at <= now else "completed"))
    return out


async def results(db: Database, batch_id: str) -> list[LineResult]:
    """Every line of the batch in input order, with its result where it has one."""
    t = batch_lines
    query = (select(t.c.line, t.c.custom_id, t.c.state, t.c.status_code, t.c.result)
             .where(t.c.batch_id == batch_id).order_by(t.c.line))
    async with db.engine.connect() as conn:
        return [LineResult(*row) for row in (await conn.execute(query)).all()]


async def finalize(db: Database, record: BatchRecord, status: str, *, now: datetime,
                   files: Sequence[tuple[str, FileRecord, bytes]]) -> bool:
    """End the batch in `status` with its result files (`(column, file, bytes)`), in one
    transaction, if it is still as `record` saw it; False if another process ended it."""
    ids = {column: file.id for column, file, _ in files}
    query = (update(batches)
             .where(batches.c.id == record.id, batches.c.status == record.status)
             .values(status=status, ended_at=now, **ids))
    async with db.engine.begin() as conn:
        if not (await conn.execute(query)).rowcount:
            return False
        for _, file, content in files:
            await add_file(conn, file, content)
    return True
