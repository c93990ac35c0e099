"""The batch lane yields to live traffic: while this process has live requests in
flight it runs at most `YIELD_LINES` lines; without, up to its concurrency (through the
real store on SQLite; each line's run is a stand-in that only counts how many run)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path

from tokenyard.gateway.batches import YIELD_LINES, Batches, BatchLane, BatchSettings, Dialect
from tokenyard.store import KeyContext, Limits, Scopes
from tokenyard.store import batches as rows
from tokenyard.store.batches import BatchRecord, Claimed, NewLine
from tokenyard.store.db import Database
from tokenyard.store.repo import Store
from tokenyard.store.sql import utcnow

LINES, CONCURRENCY = 12, 6


def _batch(batch_id: str) -> BatchRecord:
    now = utcnow()
    return BatchRecord(batch_id, "openai", "org_a", None, "key_a", "/v1/chat/completions",
                       None, "24h", None, "in_progress", LINES, 10 * LINES, None, None, now,
                       now, now + timedelta(hours=24), None, None)


async def _most_at_once(db: Database, batch_id: str, live: int) -> int:
    running, most = 0, 0

    async def run(line: Claimed, key: object) -> tuple[int, str]:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.05)
        running -= 1
        return 200, "{}"

    await rows.create_batch(db, _batch(batch_id),
                            [NewLine(f"c{i}", "{}", f"k{i}") for i in range(LINES)])
    batches = Batches(Store(db), BatchSettings(concurrency=CONCURRENCY, poll_s=0.02))
    lane = BatchLane(batches, {"openai": Dialect(run, lambda *_: [])}, lambda: live)
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
    async def run(line: Claimed, key: object) -> tuple[int, str]:
        return 200, "{}"

    async def scenario() -> float:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'tokenyard.db'}")
        batches = Batches(Store(db), BatchSettings(concurrency=CONCURRENCY, poll_s=30.0))
        lane = BatchLane(batches, {"openai": Dialect(run, lambda *_: [])}, lambda: 0)
        lane.start()
        try:
            await asyncio.sleep(0.2)  # the lane found nothing and waits for its next poll
            key = KeyContext("key_a", "k", "sk-ty-a", "org_a", None, None, Scopes(),
                             Limits(), Limits(), None, None, None)
            start = time.perf_counter()
            await batches.create(key, dialect="openai", batch_id="batch_woken",
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
