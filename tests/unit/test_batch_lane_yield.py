"""The batch lane yields to live traffic: while this process has live requests in
flight it runs at most `YIELD_LINES` lines; without, up to its concurrency (through the
real store on SQLite; each line's run is a stand-in that only counts how many run)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

from tokenyard.gateway.batches import YIELD_LINES, Batches, BatchLane, BatchSettings, Dialect
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
