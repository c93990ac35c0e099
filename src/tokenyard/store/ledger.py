"""The usage ledger writer: settled usage, journaled at once, committed in batches.

The request path only calls `LedgerWriter.append`, which writes one JSON line to this
process's journal and queues the record; a background task commits batches. Each batch
is one transaction: insert the rows with ON CONFLICT (request_id) DO NOTHING and take
the cost of the rows that were new off their orgs' prepaid balances. Replaying a journal
(after a crash, or twice) therefore never bills a request twice. A writer replays the
journals of dead writers in its directory when it starts and every `ORPHAN_SCAN_S` while
it runs, so a gateway killed beside a live one (sharing its state directory) has its
last rows committed by that one, without waiting for a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict
from dataclasses import dataclass, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tokenyard.store.db import Database
from tokenyard.store.journal import Segment, orphans
from tokenyard.store.sql import insert_for, utcnow
from tokenyard.store.tables import balances, usage_ledger

log = logging.getLogger(__name__)

STATUSES = frozenset({"completed", "stopped", "aborted", "failed"})
RETRY_MIN_S = 0.05
RETRY_MAX_S = 5.0
#: Between a running writer's looks for dead writers' journals to replay.
ORPHAN_SCAN_S = 5.0


@dataclass(frozen=True)
class UsageRecord:
    """One request's settled usage: token counts and its cost in micros.

    `prompt_tokens` counts every prompt token, cached ones included (the OpenAI
    convention); `created_at` defaults to the time of `append`.
    """

    request_id: str
    org_id: str
    model: str
    endpoint: str  # e.g. "/v1/chat/completions"
    status: str  # completed, stopped, aborted or failed
    prompt_tokens: int
    cached_tokens: int = 0
    output_tokens: int = 0
    cache_write_5m_tokens: int = 0  # prompt tokens written to the prompt cache for 5 min
    cache_write_1h_tokens: int = 0  # ... and for 1 h
    cost_micros: int = 0
    project_id: str | None = None
    key_id: str | None = None
    created_at: datetime | None = None
    region: str | None = None  # the serving deployment's (None: it declares none)
    user_id: str | None = None  # the key's user (None: a key of no user)
    batch_id: str | None = None  # the batch the request was a line of (None: live)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {sorted(STATUSES)}, not {self.status!r}")

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (created_at as ISO 8601 text)."""
        # Fields are flat scalars: a shallow dict, not asdict's recursive deep copy.
        value = {name: getattr(self, name) for name in _FIELDS}
        value["created_at"] = self.created_at.isoformat() if self.created_at else None
        return value

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> UsageRecord:
        """Inverse of `to_json`."""
        # Unknown keys (a journal written by another version) are ignored, not fatal.
        known = {name: value[name] for name in _FIELDS if name in value}
        created = known.get("created_at")
        known["created_at"] = datetime.fromisoformat(created) if created else None
        return cls(**known)

    def row(self) -> dict[str, Any]:
        """The `usage_ledger` row: adds `day`, the UTC date of created_at."""
        created = self.created_at or utcnow()
        value = {name: getattr(self, name) for name in _FIELDS}
        value["created_at"] = created
        value["day"] = created.date().isoformat()
        return value


_FIELDS = tuple(field.name for field in fields(UsageRecord))
_INSERTS: dict[str, Any] = {}


def _insert_usage(dialect: str) -> Any:
    """INSERT … ON CONFLICT (request_id) DO NOTHING RETURNING request_id, built once per
    dialect so that SQLAlchemy's compiled cache keeps hitting."""
    query = _INSERTS.get(dialect)
    if query is None:
        query = _INSERTS[dialect] = (
            insert_for(dialect, usage_ledger)
            .on_conflict_do_nothing(index_elements=["request_id"])
            .returning(usage_ledger.c.request_id)
        )
    return query


async def commit_usage(conn: AsyncConnection, records: list[UsageRecord]) -> int:
    """Insert `records` on `conn` (in the caller's transaction) and debit prepaid balances
    by the cost of the rows that were new. Returns how many were new."""
    # The first record of each request id, in the order settled: rows' ids then follow
    # the order requests were settled in (a dict built over `reversed` reversed each batch).
    first: dict[str, UsageRecord] = {}
    for record in records:
        first.setdefault(record.request_id, record)
    unique = list(first.values())
    inserted: set[str] = set()
    if unique:
        # One statement per dialect, executed with many parameter sets: SQLAlchemy compiles
        # it once and batches the rows itself ("insertmanyvalues", RETURNING included),
        # where a fresh multi-row VALUES statement was compiled again on every flush.
        result = await conn.execute(
            _insert_usage(conn.dialect.name), [record.row() for record in unique]
        )
        inserted.update(result.scalars())
    debits: dict[str, int] = defaultdict(int)
    for record in unique:
        if record.request_id in inserted:
            debits[record.org_id] += record.cost_micros
    # Orgs in a fixed order: two gateways flushing at once lock balance rows alike and
    # cannot deadlock. Orgs without a balance row (postpaid) match nothing.
    params = [{"b_org": org, "b_cost": cost} for org, cost in sorted(debits.items()) if cost]
    if params:
        await conn.execute(
            update(balances)
            .where(balances.c.org_id == bindparam("b_org"))
            .values(balance_micros=balances.c.balance_micros - bindparam("b_cost")),
            params,
        )
    return len(inserted)


class LedgerWriter:
    """Appends usage off the request path; a crash (even kill -9) loses nothing appended.

    Journal segments live in `journal_dir`, one or more per live writer. `flush_interval`
    is the seconds between batch commits, `max_batch` the most records per transaction
    (reaching it also triggers a commit at once). Use from one event loop's thread.
    """

    def __init__(
        self,
        db: Database,
        journal_dir: str | Path,
        flush_interval: float = 0.05,
        max_batch: int = 500,
    ) -> None:
        self.db = db
        self.journal_dir = Path(journal_dir)
        self.flush_interval = flush_interval
        self.max_batch = max_batch
        self._segment: Segment | None = None  # where append writes now
        self._pending: list[tuple[Segment, UsageRecord]] = []
        self._appended = 0  # records appended since start
        self._committed = 0  # of those, records committed (always a prefix of them)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Replay and remove dead writers' journals, then start the background flusher."""
        self.journal_dir.mkdir(parents=True, exist_ok=True)
        replayed = await self.replay_orphans()
        if replayed:
            log.info("ledger: recovered %d records from dead writers' journals", replayed)
        self._segment = Segment.create(self.journal_dir)
        self._task = asyncio.create_task(self._run(), name="ledger-writer")

    async def replay_orphans(self) -> int:
        """Commit every record in journals of dead writers, then delete those journals.

        Idempotent: rows already in the ledger are skipped and not billed again.
        Returns the number of rows that were new.
        """
        new = 0
        adopted = orphans(self.journal_dir)
        try:
            while adopted:
                segment = adopted[0]
                records = []
                for line in segment.read_lines():
                    try:
                        records.append(UsageRecord.from_json(json.loads(line)))
                    except (ValueError, TypeError):
                        log.error("ledger: unreadable line in %s: %r", segment.path, line[:200])
                for start in range(0, len(records), self.max_batch):
                    async with self.db.engine.begin() as conn:
                        new += await commit_usage(conn, records[start : start + self.max_batch])
                adopted.pop(0).remove()
        finally:
            for segment in adopted:
                segment.close()  # unlocked and still on disk: the next start retries it
        return new

    def append(self, record: UsageRecord) -> None:
        """Journal `record` and queue it for the next batch. Synchronous, no I/O wait."""
        if self._segment is None or self._stopping:
            raise RuntimeError("LedgerWriter.append before start() or after close()")
        if record.created_at is None:
            record = replace(record, created_at=utcnow())  # replays must keep the same day
        line = json.dumps(record.to_json(), separators=(",", ":")) + "\n"
        self._segment.write(line.encode())
        self._pending.append((self._segment, record))
        self._appended += 1
        if len(self._pending) >= self.max_batch:
            self._wake.set()

    async def flush(self) -> None:
        """Wait until every record appended so far is committed (retrying while the
        database is down: wrap in `asyncio.wait_for` to bound the wait)."""
        target = self._appended
        if self._committed >= target:
            return
        if self._task is None or self._task.done():
            raise RuntimeError("LedgerWriter is not running")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, future))
        self._wake.set()
        await future

    async def close(self, timeout: float | None = None) -> None:
        """Commit what is pending and stop. After `timeout` seconds (None: no limit) stop
        anyway: what is left stays in the journal and the next writer's start replays it."""
        if self._task is None:
            return
        self._stopping = True
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            log.warning("ledger: %d records left in the journal at close", len(self._pending))
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = None
        self._release_all()
        for _, future in self._waiters:
            if not future.done():
                future.set_exception(RuntimeError("LedgerWriter closed before this flush"))
        self._waiters = []

    @property
    def pending(self) -> int:
        """Records appended but not committed yet."""
        return len(self._pending)

    async def _run(self) -> None:
        delay = RETRY_MIN_S
        loop = asyncio.get_running_loop()
        scanned = loop.time()
        while True:
            if not self._stopping:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.flush_interval)
            self._wake.clear()
            if loop.time() - scanned >= ORPHAN_SCAN_S and not self._stopping:
                scanned = loop.time()
                try:
                    if replayed := await self.replay_orphans():
                        log.info("ledger: recovered %d records from a dead writer's "
                                 "journal", replayed)
                except Exception:
                    log.exception("ledger: replaying dead writers' journals failed")
            while self._pending:
                try:
                    await self._commit_batch()
                    delay = RETRY_MIN_S
                except Exception:
                    # Keep the records (they are in the journal too) and retry: dropping
                    # them would lose settled usage.
                    log.exception("ledger: flush failed; retrying in %.2fs", delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_S)
            if self._stopping:
                return

    async def _commit_batch(self) -> None:
        batch = self._pending[: self.max_batch]
        current = self._segment
        if current is not None and current.lines:
            # Later appends go to a fresh segment, so that this one can be deleted once
            # all its records are committed, even while appends never pause.
            self._segment = Segment.create(self.journal_dir)
        async with self.db.engine.begin() as conn:
            await commit_usage(conn, [record for _, record in batch])
        del self._pending[: len(batch)]
        self._committed += len(batch)
        for segment, _ in batch:
            segment.unflushed -= 1
        for segment in {segment for segment, _ in batch}:
            if segment.unflushed == 0 and segment is not self._segment:
                segment.remove()
        still_waiting = []
        for target, future in self._waiters:
            if target <= self._committed:
                if not future.done():
                    future.set_result(None)
            else:
                still_waiting.append((target, future))
        self._waiters = still_waiting

    def _release_all(self) -> None:
        segments = {segment for segment, _ in self._pending}
        if self._segment is not None:
            segments.add(self._segment)
        for segment in segments:
            if segment.unflushed == 0:
                segment.remove()
            else:
                segment.close()
        self._segment = None
