"""The batch lane, through the real store on SQLite, with a stand-in line runner (each
line's run only counts how many run, or waits to be cut):

- it yields to live traffic: while this process has live requests in flight it runs at
  most `YIELD_LINES` lines; without, up to its concurrency;
- a batch created in this process starts at once, not at the next poll;
- a cancel cuts the lines in flight: each ends aborted with what it was billed for, the
  batch's row counts them as they end, and the batch ends cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

from tokenyard.gateway.batch_lane import YIELD_LINES, BatchLane
from tokenyard.gateway.batches import Batches, BatchSettings, Spent
from tokenyard.gateway.billing import Usage
from tokenyard.store import KeyContext, Limits, Scopes
from tokenyard.store import batches as rows
from tokenyard.store.batches import BatchRecord, Claimed, LineEnd, LineResult, NewLine
from tokenyard.store.db import Database
from tokenyard.store.repo import Store
from tokenyard.store.sql import utcnow

LINES, CONCURRENCY = 12, 6
KEY = KeyContext("key_a", "k", "sk-ty-a", "org_a", None, None, Scopes(), Limits(),
                 Limits(), None, None, None)


class StandIn:
    """A `LineRunner` whose lines run `work(line, spent)` and answer 200."""

    def __init__(self, work: Callable[[Claimed, Spent], asyncio.Future[None] | None]
                 | None = None) -> None:
        self.work = work

    async def run(self, line: Claimed, key: KeyContext | None, spent: Spent) -> LineEnd:
        if self.work is not None:
            pending = self.work(line, spent)
            if pending is not None:
                await pending
        return spent.end(line, 200, "{}")

    def result_files(self, record: BatchRecord, results: Sequence[LineResult],
                     status: str) -> list[tuple[str, str, bytes]]:
        return []


def _batch(batch_id: str) -> BatchRecord:
    now = utcnow()
    return BatchRecord(batch_id, "openai", "org_a", None, "key_a", "/v1/chat/completions",
                       None, "24h", None, "in_progress", LINES, 10 * LINES, None, None, now,
                       now, now + timedelta(hours=24), None, None)


async def _most_at_once(db: Database, batch_id: str, live: int) -> int:
    running, most = 0, 0

    async def count(line: Claimed, spent: Spent) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.05)
        running -= 1

    await rows.create_batch(db, _batch(batch_id),
                            [NewLine(f"c{i}", "{}", f"k{i}") for i in range(LINES)])
    batches = Batches(Store(db), BatchSettings(concurrency=CONCURRENCY, poll_s=0.02))
    lane = BatchLane(batches, StandIn(lambda line, spent: asyncio.ensure_future(
        count(line, spent))), lambda: live)
    lane.start()
    try:
        for _ in range(400):
            if (await rows.line_counts(db, batch_id))["succeeded"] == LINES:
                break
            await asyncio.sleep(0.02)
        assert (await rows.line_counts(db, batch_id))["succeeded"] == LINES
    finally:
        await lane.close()
    return most


def test_the_lane_runs_one_line_at_a_time_while_live_requests_are_in_flight(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'tokenyard.db'}")
        try:
            assert await _most_at_once(db, "batch_idle", live=0) == CONCURRENCY
            assert await _most_at_once(db, "batch_busy", live=2) == YIELD_LINES
        finally:
            await db.close()

    asyncio.run(scenario())


def test_a_batch_created_in_this_process_starts_at_once_not_at_the_next_poll(
        tmp_path: Path) -> None:
    """The lane polls the store every 30 s here: the batch's lines still run within a
    second of its creation, because creating it wakes the lane."""
    async def scenario() -> float:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'tokenyard.db'}")
        batches = Batches(Store(db), BatchSettings(concurrency=CONCURRENCY, poll_s=30.0))
        lane = BatchLane(batches, StandIn(), lambda: 0)
        lane.start()
        try:
            await asyncio.sleep(0.2)  # the lane found nothing and waits for its next poll
            start = time.perf_counter()
            await batches.create(KEY, dialect="openai", batch_id="batch_woken",
                                 endpoint="/v1/chat/completions",
                                 lines=[NewLine(f"c{i}", "{}", f"k{i}") for i in range(3)],
                                 tokens=30)
            while (await rows.line_counts(db, "batch_woken"))["succeeded"] < 3:
                assert time.perf_counter() - start < 5, "the lane waited for its poll"
                await asyncio.sleep(0.02)
            return time.perf_counter() - start
        finally:
            await lane.close()
            await db.close()

    assert asyncio.run(scenario()) < 5


def test_a_cancel_cuts_the_lines_in_flight_and_keeps_what_they_were_billed(
        tmp_path: Path) -> None:
    """Each line settles 3 prompt tokens as soon as it starts, then would run for 1,000 s:
    only a cut ends it. After the cancel every line in flight ends aborted (billed its 3
    tokens), the rest never runs, and the batch ends cancelled with its row's counts
    matching its lines."""
    started: list[int] = []

    def forever(line: Claimed, spent: Spent) -> asyncio.Future[None]:
        started.append(line.line)
        spent.usage = Usage(3, 0, 0)
        return asyncio.ensure_future(asyncio.sleep(1000))

    async def scenario() -> None:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'tokenyard.db'}")
        # A long poll: the cut comes from this process's cancel waking the lane.
        batches = Batches(Store(db), BatchSettings(concurrency=CONCURRENCY, poll_s=30.0))
        lane = BatchLane(batches, StandIn(forever), lambda: 0)
        lane.start()
        try:
            await batches.create(KEY, dialect="openai", batch_id="batch_cut",
                                 endpoint="/v1/chat/completions",
                                 lines=[NewLine(f"c{i}", "{}", f"k{i}")
                                        for i in range(LINES)], tokens=10)
            while len(started) < CONCURRENCY:
                await asyncio.sleep(0.02)
            assert await batches.cancel(KEY, "batch_cut", "openai")
            for _ in range(1500):  # never ends without the cut (each line runs 1,000 s)
                record = await batches.get(KEY, "batch_cut", "openai")
                assert record is not None
                if record.status == "cancelled":
                    break
                await asyncio.sleep(0.02)
            assert record.status == "cancelled"
            assert (record.succeeded, record.failed, record.cancelled) == (
                0, 0, CONCURRENCY)
            assert record.unended == LINES - CONCURRENCY  # never claimed
            assert (record.input_tokens, record.output_tokens) == (3 * CONCURRENCY, 0)
            counts = await rows.line_counts(db, "batch_cut")
            assert counts["cancelled"] == record.cancelled
            assert counts["queued"] == record.unended and counts["running"] == 0
            assert sorted(started) == sorted(set(started))  # none ran twice
        finally:
            await lane.close()
            await db.close()

    asyncio.run(scenario())
