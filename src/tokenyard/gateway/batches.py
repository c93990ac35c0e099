"""The Batch API's batches in the store, as the routes use them, and what the lane needs
of a dialect to run their lines.

`Batches` is what the HTTP routes call (files, creation under the org's enqueued-token
quota, lookups, cancel). `BatchSettings` are the lane's settings, from the serving
process's `ServeConfig` (`tokenyard serve`'s flags over its environment), handed down
when the application is built. `LineRunner` is the one thing the lane
(`gateway/batch_lane.py`) is given from above: how a claimed line runs (through
`Pipeline.run`, like a live request) and what an ended batch's result files hold.

Exactly once: a line's request id is its batch id and line number, and the ledger keeps
one row per request id (`ON CONFLICT DO NOTHING`, the journal replayed after a crash), so
a line run again after a `kill -9` never bills twice; its result row is written once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from tokenyard.config import ServeConfig
from tokenyard.errors import APIError
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.billing import Usage
from tokenyard.store import batches as rows
from tokenyard.store import files as stored_files
from tokenyard.store.batches import BatchRecord, Claimed, LineEnd, LineResult, NewLine
from tokenyard.store.db import Database
from tokenyard.store.files import FileRecord, new_file_id
from tokenyard.store.repo import Store
from tokenyard.store.sql import utcnow

#: The one completion window both APIs offer.
WINDOW = timedelta(hours=24)


@dataclass(frozen=True)
class BatchSettings:
    #: Lines one gateway process runs at once (live traffic preempts them in the engine).
    concurrency: int = ServeConfig.batch_concurrency
    #: How long a claimed line stays its worker's without a renewal.
    lease_s: float = ServeConfig.batch_lease_s
    #: Between looks at the store when there is nothing to claim.
    poll_s: float = 0.5
    #: An org's batches still at work may hold at most this many (estimated) tokens,
    #: unless the org has its own quota (`orgs.batch_enqueued_tokens`).
    enqueued_tokens: int = ServeConfig.batch_enqueued_tokens

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


@dataclass
class Spent:
    """What a running line was billed for, once its run settled (None: nothing ran): the
    runner fills it however the line ends, so a line cut by a cancel keeps it."""

    usage: Usage | None = None

    def end(self, line: Claimed, status_code: int | None, result: str | None) -> LineEnd:
        """The line's end with this usage (`result` None: aborted by a cancel)."""
        u = self.usage
        return LineEnd(line.batch_id, line.line, status_code, result,
                       u.prompt_tokens if u else 0, u.cached_tokens if u else 0,
                       u.output_tokens if u else 0)


class LineRunner(Protocol):
    """How the lines of a batch run and what an ended batch leaves, in its dialect."""

    def run(self, line: Claimed, key: KeyContext | None, spent: Spent) -> Awaitable[LineEnd]:
        """Run one line under `key` (None: revoked) and answer its end; raise `Busy` for a
        refusal that passes. Fills `spent` whatever happens (cancelled too)."""
        ...

    def result_files(self, record: BatchRecord, results: Sequence[LineResult],
                     status: str) -> Sequence[tuple[str, str, bytes]]:
        """The ended batch's files: (column, file name, bytes) each."""
        ...


class Batches:
    """Files and batches as the routes use them; every call names the caller's org."""

    def __init__(self, store: Store, settings: BatchSettings) -> None:
        self.store = store
        self.db: Database = store.db
        self.settings = settings
        #: Called when this process creates or cancels a batch: its lane looks at the
        #: store now, not after up to `poll_s` (a batch's first lines then start at once,
        #: a cancelled one's lines in flight are cut at once).
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
                     lines: Sequence[NewLine], tokens: int, model: str | None = None,
                     input_file_id: str | None = None,
                     metadata: Mapping[str, str] | None = None) -> BatchRecord:
        """A new batch of `lines` (estimated at `tokens`; naming `model`), in progress at
        once; 429 naming the quota when the org's batches at work would hold more."""
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
            expires_at=now + WINDOW, cancelling_at=None, ended_at=None,
            model=model[:255] if model else None)
        await rows.create_batch(self.db, record, lines)
        self._changed()
        return record

    async def get(self, key: KeyContext, batch_id: str, dialect: str) -> BatchRecord | None:
        return await rows.get_batch(self.db, batch_id, key.org_id, dialect)

    async def page(self, key: KeyContext, dialect: str, *, limit: int,
                   after: str | None = None, before: str | None = None) -> list[BatchRecord]:
        return await rows.list_batches(self.db, key.org_id, dialect, limit=limit,
                                       after=after, before=before)

    async def cancel(self, key: KeyContext, batch_id: str, dialect: str) -> bool:
        """Mark the batch cancelling: no line of it is claimed again, and every lane cuts
        the lines of it in flight (this process's at once, others' at their next look)."""
        cancelled = await rows.cancel_batch(self.db, batch_id, key.org_id, dialect, utcnow())
        self._changed()
        return cancelled

    async def delete(self, key: KeyContext, batch_id: str, dialect: str) -> bool:
        return await rows.delete_batch(self.db, batch_id, key.org_id, dialect)

    async def results(self, batch_id: str) -> list[LineResult]:
        return await rows.results(self.db, batch_id)


__all__ = ["WINDOW", "BatchRecord", "BatchSettings", "Batches", "Busy", "Claimed",
           "FileRecord", "LineEnd", "LineResult", "LineRunner", "NewLine", "Spent",
           "busy_wait", "line_request_id"]
