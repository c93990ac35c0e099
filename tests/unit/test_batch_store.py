"""Batch lines in the store: two workers never claim the same line, a line whose lease
ran out is claimed again and its first worker can no longer write its result (and keeps
its batch open until then), a batch ends once (its files with it), and a cancelled batch
ends when nothing runs.
Backend-neutral: tests/integration/test_store_postgres.py runs it on PostgreSQL too."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from tokenyard.store import batches as rows
from tokenyard.store.batches import BatchRecord, NewLine
from tokenyard.store.db import Database
from tokenyard.store.files import FileRecord, file_content
from tokenyard.store.sql import utcnow


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'state' / 'tokenyard.db'}"


def _batch(batch_id: str, total: int) -> BatchRecord:
    now = utcnow()
    return BatchRecord(batch_id, "openai", "org_a", None, "key_a", "/v1/chat/completions",
                       None, "24h", None, "in_progress", total, 10 * total, None, None, now,
                       now, now + timedelta(hours=24), None, None)


def test_claims_leases_results_and_ending_once(database_url: str) -> None:
    async def scenario() -> None:
        db = await Database.open(database_url)
        try:
            # Sort keys out of line order: claims follow the sort key.
            lines = [NewLine(f"c{i}", "{}", f"k{(i * 7) % 10}") for i in range(10)]
            await rows.create_batch(db, _batch("batch_1", 10), lines)
            now = utcnow()
            a, b = await asyncio.gather(
                rows.claim(db, "A", now=now, lease_s=60, limit=4),
                rows.claim(db, "B", now=now, lease_s=60, limit=4))
            got_a, got_b = {c.line for c in a}, {c.line for c in b}
            assert len(got_a) == len(got_b) == 4 and not got_a & got_b
            first = a if a[0].custom_id == "c0" else b
            assert [c.custom_id for c in first] == ["c0", "c3", "c6", "c9"]  # k0..k3

            line = a[0].line
            assert not await rows.finish_line(db, "batch_1", line, "B", status_code=200,
                                              result="x", now=now)
            assert await rows.finish_line(db, "batch_1", line, "A", status_code=200,
                                          result="ok", now=now)
            assert not await rows.finish_line(db, "batch_1", line, "A", status_code=200,
                                              result="again", now=now)

            # A dies: once its leases are past, C takes its lines; A's result is refused.
            later = now + timedelta(seconds=61)
            assert await rows.renew(db, "B", now=later - timedelta(seconds=2), lease_s=60) == 4
            c = await rows.claim(db, "C", now=later, lease_s=60, limit=10)
            assert {x.line for x in c} == (got_a - {line}) | (set(range(10)) - got_a - got_b)
            assert not await rows.finish_line(db, "batch_1", a[1].line, "A", status_code=200,
                                              result="late", now=later)
            for x in [*c, *b]:
                worker = "C" if x in c else "B"
                assert await rows.finish_line(db, "batch_1", x.line, worker,
                                              status_code=200 if x.line % 2 else 400,
                                              result=f"r{x.line}", now=later)
            counts = await rows.line_counts(db, "batch_1")
            odd = sum(1 for i in range(10) if i != line and i % 2)
            assert counts == {"queued": 0, "running": 0, "succeeded": odd + 1,
                              "failed": 9 - odd, "cancelled": 0}
            # The batch's row kept the same counts as its lines ended (a status read).
            row = await rows.get_batch(db, "batch_1", "org_a", "openai")
            assert row is not None and (row.succeeded, row.failed, row.unended) == (
                odd + 1, 9 - odd, 0)
            results = await rows.results(db, "batch_1")
            assert [r.custom_id for r in results] == [f"c{i}" for i in range(10)]
            assert results[line].result == "ok"

            due = await rows.due(db, later)
            assert [(r.id, status) for r, status in due] == [("batch_1", "completed")]
            out = FileRecord("file-out", "org_a", None, "o.jsonl", "batch_output", 3, 1, later)
            assert await rows.finalize(db, due[0][0], "completed", now=later,
                                       files=[("output_file_id", out, b"ok\n")])
            assert not await rows.finalize(db, due[0][0], "completed", now=later, files=[])
            ended = await rows.get_batch(db, "batch_1", "org_a", "openai")
            assert ended is not None and ended.status == "completed"
            assert ended.output_file_id == "file-out"
            assert await file_content(db, "file-out", "org_a") == b"ok\n"
            assert await file_content(db, "file-out", "org_b") is None
            assert await rows.get_batch(db, "batch_1", "org_b", "openai") is None

            # Cancel: nothing more is claimed; it ends once its running line is done.
            await rows.create_batch(db, _batch("batch_2", 3), lines[:3])
            running = await rows.claim(db, "A", now=later, lease_s=60, limit=1)
            assert await rows.cancel_batch(db, "batch_2", "org_a", "openai", later)
            assert not await rows.cancel_batch(db, "batch_2", "org_a", "openai", later)
            assert await rows.claim(db, "B", now=later, lease_s=60, limit=5) == []
            assert await rows.due(db, later) == []
            await rows.finish_line(db, "batch_2", running[0].line, "A", status_code=200,
                                   result="done", now=later)
            assert [s for _, s in await rows.due(db, later)] == ["cancelled"]
            assert await rows.enqueued_tokens(db, "org_a") == (30, None)  # batch_2 counts

            # Ends are written in groups: one transaction, each only if still held; an
            # aborted line (cut by a cancel) counts as cancelled, with what it was billed.
            await rows.create_batch(db, _batch("batch_5", 3), lines[:3])
            held5 = await rows.claim(db, "F", now=later, lease_s=60, limit=3)
            ends = [rows.LineEnd("batch_5", held5[0].line, 200, "ok", 5, 2, 7),
                    rows.LineEnd("batch_5", held5[1].line, None, None, 4, 0, 1),
                    rows.LineEnd("batch_5", held5[2].line, 429, "no", 0, 0, 0)]
            written = await rows.finish_lines(db, "F", ends, now=later)
            assert written == ends
            assert await rows.finish_lines(db, "F", ends, now=later) == []  # once only
            row5 = await rows.get_batch(db, "batch_5", "org_a", "openai")
            assert row5 is not None
            assert (row5.succeeded, row5.failed, row5.cancelled, row5.unended) == (1, 1, 1, 0)
            assert (row5.input_tokens, row5.cached_tokens, row5.output_tokens) == (9, 2, 8)
            assert (await rows.line_counts(db, "batch_5"))["cancelled"] == 1
            assert await rows.statuses(db, ["batch_5", "batch_2", "nope"]) == {
                "batch_5": "in_progress", "batch_2": "cancelling"}
            assert ("batch_5", "completed") in [(r.id, s) for r, s in await rows.due(db, later)]

            # Past its window: nothing is claimed from it, and it ends expired.
            old = _batch("batch_3", 2)
            old = BatchRecord(**{**old.__dict__, "expires_at": later - timedelta(seconds=1)})
            await rows.create_batch(db, old, lines[:2])
            assert await rows.claim(db, "A", now=later, lease_s=60, limit=5) == []
            assert ("batch_3", "expired") in [(r.id, s) for r, s in await rows.due(db, later)]

            # Its worker died with one line left, under a lease now past: the batch is not
            # done (it ended "completed" with that line unrun before); another worker runs it.
            await rows.create_batch(db, _batch("batch_4", 2), lines[:2])
            held = await rows.claim(db, "D", now=later, lease_s=1, limit=2)
            assert await rows.finish_line(db, "batch_4", held[0].line, "D", status_code=200,
                                          result="one", now=later)
            after = later + timedelta(seconds=2)
            assert "batch_4" not in [r.id for r, _ in await rows.due(db, after)]
            again = await rows.claim(db, "E", now=after, lease_s=60, limit=2)
            assert [x.line for x in again] == [held[1].line]
            assert await rows.finish_line(db, "batch_4", held[1].line, "E", status_code=200,
                                          result="two", now=after)
            assert ("batch_4", "completed") in [(r.id, s) for r, s in await rows.due(db, after)]
        finally:
            await db.close()

    asyncio.run(scenario())
