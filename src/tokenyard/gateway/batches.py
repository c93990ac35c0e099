"""The Batch API's lane: batches in the store, run by a worker in every gateway process.

`Batches` is what the HTTP routes call (files, creation under the org's enqueued-token
quota, lookups, cancel); `BatchLane` is the worker. It claims a few lines at a time from
the store (`store/batches.claim`: a lease, so a line whose gateway died is claimed again
once the lease is past), runs each through the dialect's `LineRunner` — the same
`Pipeline.run` a live request takes, under the batch owner's key, at `BATCH_PRIORITY`
and the batch price — with at most `concurrency` lines in flight in this process (by
default 128, a replica's `max_num_seqs`: the lane fills a replica's idle seats as the
engine alone would). Live traffic still gets the replicas first: the balancer's queue
and the engine's scheduler serve lower priority numbers first, so a live prompt goes
ahead of the batch lines' prompts in a step, and takes a batch line's seat or KV blocks
by preempting it when they are full. The lane writes each result only while it still
holds the line, and ends batches whose lines are done (or that were cancelled, or
outlived their window), writing their result files once.

Exactly once: a line's request id is its batch id and line number, and the ledger keeps
one row per request id (`ON CONFLICT DO NOTHING`, the journal replayed after a crash), so
a line run again after a `kill -9` never bills twice; its result row is written once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from tokenyard.config import ServeConfig
from tokenyard.errors import APIError
from tokenyard.gateway.auth import KeyContext
from tokenyard.store import batches as rows
from tokenyard.store import files as stored_files
from tokenyard.store.batches import BatchRecord, Claimed, LineResult, NewLine
from tokenyard.store.db import Database
from tokenyard.store.files import FileRecord, new_file_id
from tokenyard.store.repo import Store
from tokenyard.store.sql import utcnow

logger = logging.getLogger("tokenyard.gateway.batches")

#: The one completion window both APIs offer.
WINDOW = timedelta(hours=24)
#: While live requests are in flight in this process, and this long after the last,
#: the lane runs at most `YIELD_LINES` lines.
YIELD_S = 2.0
YIELD_LINES = 1


@dataclass(frozen=True)
class BatchSettings:
    #: Lines one gateway process runs at once (live traffic preempts them in the engine).
    concurrency: int = ServeConfig.batch_concurrency
    #: How long a claimed line stays its worker's without a renewal.
    lease_s: float = 60.0
    #: Between looks at the store when there is nothing to claim.
    poll_s: float = 0.5
    #: An org's batches still at work may hold at most this many (estimated) tokens,
    #: unless the org has its own quota (`orgs.batch_enqueued_tokens`).
    enqueued_tokens: int = 20_000_000

    @classmethod
    def of(cls, config: ServeConfig) -> BatchSettings:
        """The settings `config` holds (its `batch_*` fields)."""
        return cls(concurrency=config.batch_concurrency, lease_s=config.batch_lease_s,
                   enqueued_tokens=config.batch_enqueued_tokens)


class Busy(Exception):
    """A line refused for now (the limits, a full replica queue): it goes back to the
    queue, and this worker claims nothing for `retry_after_s`."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


def busy_wait(err: APIError) -> float | None:
    """How long to wait before a line refused by a passing condition (the limits, a full
    replica queue) runs again; None for a refusal that is its result."""
    if err.status != 503 and err.code != "rate_limit_exceeded":
        return None
    try:
        return max(0.1, float(err.headers.get("retry-after", "1")))
    except ValueError:
        return 1.0


def line_request_id(batch_id: str, line: int) -> str:
    """A line's request id: the same every time it runs (its ledger row's key)."""
    return f"{batch_id}-{line}"


class LineRunner(Protocol):
    """A dialect's runner of one line: its status code and its result, as stored."""

    def __call__(self, line: Claimed, key: KeyContext | None) -> Awaitable[tuple[int, str]]:
        ...


#: A dialect's result files of an ended batch: (column, file name, bytes) each, from its
#: lines' results and the status it ended in.
ResultFiles = Callable[[BatchRecord, Sequence[LineResult], str],
                       Sequence[tuple[str, str, bytes]]]


@dataclass(frozen=True)
class Dialect:
    run: LineRunner
    result_files: ResultFiles


class Batches:
    """Files and batches as the routes use them; every call names the caller's org."""

    def __init__(self, store: Store, settings: BatchSettings) -> None:
        self.store = store
        self.db: Database = store.db
        self.settings = settings
        #: Called when this process creates or cancels a batch: its lane looks at the
        #: store now, not after up to `poll_s` (a batch's first lines then start at once).
        self.changed: list[Callable[[], None]] = []

    def _changed(self) -> None:
        for call in self.changed:
            call()

    # -- files
    async def add_file(self, key: KeyContext, filename: str, purpose: str, content: bytes,
                       lines: int) -> FileRecord:
        record = FileRecord(new_file_id(), key.org_id, key.project_id, filename, purpose,
                            len(content), lines, utcnow())
        await stored_files.insert_file(self.db, record, content)
        return record

    async def file(self, key: KeyContext, file_id: str) -> FileRecord | None:
        return await stored_files.get_file(self.db, file_id, key.org_id)

    async def file_content(self, key: KeyContext, file_id: str) -> bytes | None:
        return await stored_files.file_content(self.db, file_id, key.org_id)

    async def files(self, key: KeyContext, *, purpose: str | None, limit: int,
                    after: str | None, newest_first: bool) -> list[FileRecord]:
        return await stored_files.list_files(self.db, key.org_id, purpose=purpose,
                                             limit=limit, after=after,
                                             newest_first=newest_first)

    async def delete_file(self, key: KeyContext, file_id: str) -> bool:
        return await stored_files.delete_file(self.db, file_id, key.org_id)

    # -- batches
    async def create(self, key: KeyContext, *, dialect: str, batch_id: str, endpoint: str,
                     lines: Sequence[NewLine], tokens: int, input_file_id: str | None = None,
                     metadata: Mapping[str, str] | None = None) -> BatchRecord:
        """A new batch of `lines` (estimated at `tokens`), in progress at once; 429
        naming the quota when the org's batches at work would hold more tokens."""
        held, own = await rows.enqueued_tokens(self.db, key.org_id)
        limit = self.settings.enqueued_tokens if own is None else own
        if held + tokens > limit:
            whose = "the gateway's default" if own is None else "the organization's own"
            raise APIError(
                429, f"Enqueued token limit reached for organization {key.org_id}: its "
                f"batches at work hold {held} tokens, this batch needs {tokens}, and the "
                f"limit (batch_enqueued_tokens, {whose}) is {limit}. Wait for batches to "
                "finish.",
                code="batch_enqueued_token_limit_exceeded",
                headers={"x-should-retry": "false"})
        now = utcnow()
        record = BatchRecord(
            id=batch_id, dialect=dialect, org_id=key.org_id, project_id=key.project_id,
            key_id=key.key_id, endpoint=endpoint, input_file_id=input_file_id,
            completion_window="24h", metadata=dict(metadata) if metadata else None,
            status="in_progress", total=len(lines), enqueued_tokens=tokens,
            output_file_id=None, error_file_id=None, created_at=now, in_progress_at=now,
            expires_at=now + WINDOW, cancelling_at=None, ended_at=None)
        await rows.create_batch(self.db, record, lines)
        self._changed()
        return record

    async def get(self, key: KeyContext, batch_id: str, dialect: str) -> BatchRecord | None:
        return await rows.get_batch(self.db, batch_id, key.org_id, dialect)

    async def page(self, key: KeyContext, dialect: str, *, limit: int,
                   after: str | None = None, before: str | None = None) -> list[BatchRecord]:
        return await rows.list_batches(self.db, key.org_id, dialect, limit=limit,
                                       after=after, before=before)

    async def counts(self, batch_id: str) -> dict[str, int]:
        return await rows.line_counts(self.db, batch_id)

    async def cancel(self, key: KeyContext, batch_id: str, dialect: str) -> bool:
        cancelled = await rows.cancel_batch(self.db, batch_id, key.org_id, dialect, utcnow())
        self._changed()
        return cancelled

    async def delete(self, key: KeyContext, batch_id: str, dialect: str) -> bool:
        return await rows.delete_batch(self.db, batch_id, key.org_id, dialect)

    async def results(self, batch_id: str) -> list[LineResult]:
        return await rows.results(self.db, batch_id)


class BatchLane:
    """The batch worker of one gateway process (see the module's docstring).

    It yields to live traffic: `live()` is this process's live requests in flight
    (`Gateway.live_open`); while there are any, and for `YIELD_S` after, it keeps at most
    `YIELD_LINES` lines running, so the engine's steps carry live requests, not a full
    batch beside them."""

    def __init__(self, batches: Batches, dialects: Mapping[str, Dialect],
                 live: Callable[[], int] = lambda: 0) -> None:
        self.live = live
        self._live_seen = float("-inf")
        self.batches = batches
        self.db = batches.db
        self.settings = batches.settings
        self.dialects = dialects
        self.worker = f"{socket.gethostname()[:30]}:{os.getpid()}:{secrets.token_hex(4)}"
        self._running: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        batches.changed.append(self._wake.set)
        self._idle_until = 0.0  # a line came back busy: nothing is claimed until then

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self, grace_s: float = 10.0) -> None:
        """Stop claiming and give the lines still running `grace_s` to finish; those cut
        then go back to the queue when their leases run out (another worker, or this one
        after a restart, runs them again; the ledger keeps the first row of a line)."""
        with contextlib.suppress(ValueError):
            self.batches.changed.remove(self._wake.set)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        tasks = list(self._running.values())
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        renewed = asyncio.get_running_loop().time()
        while True:
            try:
                await self._end_due()
                free = self.settings.concurrency - len(self._running)
                now = asyncio.get_running_loop().time()
                if self.live() > 0:
                    self._live_seen = now
                if now - self._live_seen < YIELD_S:
                    free = min(free, YIELD_LINES - len(self._running))
                claimed: list[Claimed] = []
                if free > 0 and asyncio.get_running_loop().time() >= self._idle_until:
                    claimed = await rows.claim(self.db, self.worker, now=utcnow(),
                                               lease_s=self.settings.lease_s, limit=free)
                for line in claimed:
                    task = asyncio.create_task(self._run(line))
                    self._running[(line.batch_id, line.line)] = task
                now = asyncio.get_running_loop().time()
                if self._running and now - renewed > self.settings.lease_s / 3:
                    await rows.renew(self.db, self.worker, now=utcnow(),
                                     lease_s=self.settings.lease_s)
                    renewed = now
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("the batch worker's round failed; trying again")
                claimed = []
            if claimed and len(self._running) < self.settings.concurrency:
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.poll_s)

    async def _run(self, line: Claimed) -> None:
        try:
            key = await self.batches.store.find_key_by_id(line.key_id)
            if key is not None and not key.is_active(utcnow()):
                key = None
            status, result = await self.dialects[line.dialect].run(line, key)
            if not await rows.finish_line(self.db, line.batch_id, line.line, self.worker,
                                          status_code=status, result=result, now=utcnow()):
                logger.warning("batch %s line %d was taken over before it finished",
                               line.batch_id, line.line)
        except Busy as busy:
            self._idle_until = asyncio.get_running_loop().time() + busy.retry_after_s
            with contextlib.suppress(Exception):
                await rows.release(self.db, line.batch_id, line.line, self.worker)
        except asyncio.CancelledError:
            raise
        except Exception:
            # The store failed: the lease runs out and the line is run again.
            logger.exception("batch %s line %d failed to run", line.batch_id, line.line)
        finally:
            self._running.pop((line.batch_id, line.line), None)
            self._wake.set()

    async def _end_due(self) -> None:
        for record, status in await rows.due(self.db, utcnow()):
            dialect = self.dialects.get(record.dialect)
            if dialect is None:
                continue
            results = await rows.results(self.db, record.id)
            now = utcnow()
            files = [(column, FileRecord(new_file_id(), record.org_id, record.project_id,
                                         name, "batch_output", len(content),
                                         content.count(b"\n"), now), content)
                     for column, name, content in dialect.result_files(record, results,
                                                                       status)]
            if await rows.finalize(self.db, record, status, now=now, files=files):
                logger.info("batch %s %s", record.id, status)


__all__ = ["WINDOW", "BatchLane", "BatchRecord", "BatchSettings", "Batches", "Busy", "Claimed",
           "Dialect", "FileRecord", "LineResult", "NewLine", "busy_wait", "line_request_id"]
