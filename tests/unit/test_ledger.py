"""The ledger writer on SQLite: batches land exactly once, balances drop by exactly the
sum, journals survive kill -9 and replay idempotently, failed flushes retry.

Tests that take `database_url` run again on PostgreSQL (tests/integration/).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import select as select_module
import signal
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from tokenyard.store import Database, LedgerWriter, Store, UsageRecord
from tokenyard.store import ledger as ledger_module
from tokenyard.store.tables import usage_ledger


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'state' / 'tokenyard.db'}"


def record(i: int, org_id: str, cost: int, **fields: Any) -> UsageRecord:
    """Usage of request `req-<i>` costing `cost` micros; `fields` override the rest."""
    values: dict[str, Any] = {
        "model": "m",
        "endpoint": "/v1/chat/completions",
        "status": "completed",
        "prompt_tokens": i % 97,
        "output_tokens": i % 13,
    }
    return UsageRecord(
        request_id=f"req-{i}", org_id=org_id, cost_micros=cost, **{**values, **fields}
    )


async def ledger_totals(db: Database) -> tuple[int, int]:
    """(rows, summed cost in micros) of the whole ledger."""
    query = select(func.count(), func.coalesce(func.sum(usage_ledger.c.cost_micros), 0))
    async with db.engine.connect() as conn:
        rows, cost = (await conn.execute(query)).one()
    return int(rows), int(cost)


def journal_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("ledger-*.jsonl"))


def test_usage_record_round_trips_through_its_journal_line() -> None:
    original = record(
        1, "org_a", 5, key_id="key_x", created_at=datetime(2025, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
    )
    line = json.dumps(original.to_json())
    assert UsageRecord.from_json(json.loads(line)) == original
    assert UsageRecord.from_json({**original.to_json(), "added_later": 1}) == original
    assert original.row()["day"] == "2025-01-02"
    with pytest.raises(ValueError):
        record(1, "org_a", 0, status="ok")


def test_a_thousand_appends_all_land_and_balances_drop_by_exactly_their_sum(
    database_url: str, tmp_path: Path
) -> None:
    journal = tmp_path / "journal"
    rng = random.Random(3)

    async def scenario() -> None:
        db = await Database.open(database_url)
        store = Store(db)
        prepaid = [await store.create_org(f"p{i}", balance_micros=10**9) for i in range(2)]
        postpaid = await store.create_org("postpaid")
        orgs = [*prepaid, postpaid]
        writer = LedgerWriter(db, journal, flush_interval=0.01, max_batch=100)
        await writer.start()
        spent = {org.id: 0 for org in orgs}
        for i in range(1000):
            org = rng.choice(orgs)
            cost = rng.randrange(5000)
            spent[org.id] += cost
            writer.append(record(i, org.id, cost))
            if i % 150 == 0:
                await asyncio.sleep(0)  # let batches commit while appends continue
        await writer.flush()
        assert writer.pending == 0
        assert await ledger_totals(db) == (1000, sum(spent.values()))
        for org in prepaid:
            assert await store.balance(org.id) == 10**9 - spent[org.id]
        assert await store.balance(postpaid.id) is None  # postpaid stays unbounded
        # Committed segments are deleted: only the live, empty one remains.
        assert [f.stat().st_size for f in journal_files(journal)] == [0]
        await writer.close()
        assert journal_files(journal) == []
        await db.close()

    asyncio.run(scenario())


def test_rows_of_one_batch_are_written_in_the_order_they_were_settled(
    database_url: str, tmp_path: Path
) -> None:
    """Found by a CI run: one batch's rows were inserted in reverse, so a request settled
    after another could get the lower row id. A duplicate keeps its first record."""
    async def scenario() -> None:
        db = await Database.open(database_url)
        org = await Store(db).create_org("acme")
        writer = LedgerWriter(db, tmp_path / "journal", flush_interval=60.0)
        await writer.start()
        for i in (5, 3, 9, 1):
            writer.append(record(i, org.id, 10 * i))
        writer.append(record(3, org.id, 999))  # a second record of req-3: ignored
        await writer.flush()
        query = select(usage_ledger.c.request_id, usage_ledger.c.cost_micros).order_by(
            usage_ledger.c.id)
        async with db.engine.connect() as conn:
            rows = [tuple(row) for row in await conn.execute(query)]
        assert rows == [("req-5", 50), ("req-3", 30), ("req-9", 90), ("req-1", 10)]
        await writer.close()
        await db.close()

    asyncio.run(scenario())


def test_replaying_a_journal_twice_inserts_and_bills_nothing_twice(
    database_url: str, tmp_path: Path
) -> None:
    journal = tmp_path / "journal"
    journal.mkdir()

    async def scenario() -> None:
        db = await Database.open(database_url)
        store = Store(db)
        org = await store.create_org("acme", balance_micros=1_000_000)
        lines = [json.dumps(record(i, org.id, 10).to_json()) for i in range(50)]
        # A dead writer's journal, ending in a line torn by the crash.
        content = "\n".join(lines) + "\n" + lines[0][:20]
        orphan = journal / "ledger-999999-deadbeef.jsonl"
        orphan.write_text(content)
        writer = LedgerWriter(db, journal)
        await writer.start()
        assert not orphan.exists()
        assert await ledger_totals(db) == (50, 500)
        assert await store.balance(org.id) == 1_000_000 - 500

        orphan.write_text(content)  # the same journal again
        assert await writer.replay_orphans() == 0
        assert await ledger_totals(db) == (50, 500)
        assert await store.balance(org.id) == 1_000_000 - 500

        # Records appended live that were also replayed are not billed twice either.
        writer.append(record(0, org.id, 10))
        await writer.flush()
        assert await ledger_totals(db) == (50, 500)
        await writer.close()
        await db.close()

    asyncio.run(scenario())


def test_a_running_writer_replays_a_journal_left_by_a_writer_that_died_beside_it(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway killed beside a live one: its rows are committed by the live one within
    `ORPHAN_SCAN_S`, not only when a gateway starts again."""
    journal = tmp_path / "journal"
    monkeypatch.setattr(ledger_module, "ORPHAN_SCAN_S", 0.1)

    async def scenario() -> None:
        db = await Database.open(database_url)
        writer = LedgerWriter(db, journal)
        await writer.start()
        lines = [json.dumps(record(i, "org_a", 10).to_json()) for i in range(5)]
        orphan = journal / "ledger-999999-deadbeef.jsonl"  # written after the start
        orphan.write_text("\n".join(lines) + "\n")
        for _ in range(100):
            if not orphan.exists():
                break
            await asyncio.sleep(0.05)
        assert not orphan.exists()
        assert await ledger_totals(db) == (5, 50)
        await writer.close()
        await db.close()

    asyncio.run(scenario())


def test_a_live_writers_journal_is_not_replayed_by_another_writer(
    database_url: str, tmp_path: Path
) -> None:
    journal = tmp_path / "journal"

    async def scenario() -> None:
        db = await Database.open(database_url)
        first = LedgerWriter(db, journal, flush_interval=3600, max_batch=10_000)
        await first.start()
        first.append(record(1, "org_a", 0))
        second = LedgerWriter(db, journal)
        await second.start()  # must leave `first`'s locked segment alone
        assert await ledger_totals(db) == (0, 0)
        assert len(journal_files(journal)) == 2
        await first.close()
        await second.close()
        assert await ledger_totals(db) == (1, 0)
        await db.close()

    asyncio.run(scenario())


def test_a_failed_flush_keeps_the_records_and_retries(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_commit = ledger_module.commit_usage
    failures = {"left": 3}

    async def flaky_commit(conn: Any, records: list[UsageRecord]) -> int:
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("database is down")
        return await real_commit(conn, records)

    monkeypatch.setattr(ledger_module, "commit_usage", flaky_commit)
    monkeypatch.setattr(ledger_module, "RETRY_MIN_S", 0.001)

    async def scenario() -> None:
        db = await Database.open(database_url)
        writer = LedgerWriter(db, tmp_path / "journal", flush_interval=0.001)
        await writer.start()
        for i in range(20):
            writer.append(record(i, "org_a", 1))
        await asyncio.wait_for(writer.flush(), 10)
        assert failures["left"] == 0
        assert await ledger_totals(db) == (20, 20)
        await writer.close()
        await db.close()

    asyncio.run(scenario())


def test_close_with_the_database_down_leaves_the_records_in_the_journal(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = tmp_path / "journal"

    async def down(conn: Any, records: list[UsageRecord]) -> int:
        raise ConnectionError("database is down")

    async def scenario() -> None:
        db = await Database.open(database_url)
        with monkeypatch.context() as patch:
            patch.setattr(ledger_module, "commit_usage", down)
            writer = LedgerWriter(db, journal, flush_interval=0.001)
            await writer.start()
            for i in range(5):
                writer.append(record(i, "org_a", 1))
            await writer.close(timeout=0.2)
        assert len(journal_files(journal)) >= 1
        recovery = LedgerWriter(db, journal)
        await recovery.start()
        assert await ledger_totals(db) == (5, 5)
        await recovery.close()
        await db.close()

    asyncio.run(scenario())


KILLED_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from tokenyard.store import Database, LedgerWriter, UsageRecord

    async def main(url, journal, org_id, n):
        db = await Database.open(url)
        writer = LedgerWriter(db, journal, flush_interval=3600, max_batch=10**6)
        await writer.start()
        for i in range(n):
            writer.append(UsageRecord(
                request_id=f"killed-{i}", org_id=org_id, model="m", endpoint="/v1/completions",
                status="completed", prompt_tokens=i, output_tokens=1, cost_micros=i,
            ))
        print("appended", flush=True)
        await asyncio.sleep(3600)  # never flushes: killed first

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
    """
)


def test_kill_9_before_any_flush_loses_no_appended_record(
    database_url: str, tmp_path: Path
) -> None:
    journal = tmp_path / "journal"
    n = 300

    async def setup() -> str:
        db = await Database.open(database_url)
        org = await Store(db).create_org("acme", balance_micros=10**6)
        await db.close()
        return org.id

    org_id = asyncio.run(setup())
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, database_url, str(journal), org_id, str(n)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select_module.select([child.stdout], [], [], 30)
        assert ready and child.stdout is not None, "the writer subprocess did not start"
        assert child.stdout.readline().strip() == "appended", child.stderr and child.stderr.read()
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(10)
    assert child.returncode == -signal.SIGKILL
    (orphan,) = journal_files(journal)
    assert len(orphan.read_text().splitlines()) == n

    async def recover() -> None:
        db = await Database.open(database_url)
        assert await ledger_totals(db) == (0, 0)  # nothing was flushed before the kill
        writer = LedgerWriter(db, journal)
        await writer.start()
        expected_cost = sum(range(n))
        assert await ledger_totals(db) == (n, expected_cost)
        assert await Store(db).balance(org_id) == 10**6 - expected_cost
        assert not orphan.exists()
        await writer.close()
        await db.close()

    asyncio.run(recover())
