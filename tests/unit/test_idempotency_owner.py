"""Whose an Idempotency-Key record is.

A running claim names its process: a retry after that process died (a gateway worker
SIGKILLed mid-request) runs at once, where it used to get 409 for the claim's whole
15-minute lease; a live owner, or one on another host, still gets 409.

A record is its API key's and its route's (issue 21, finding 10): another key of the org
claims the same Idempotency-Key anew, and on another route it is a mismatch. Tests that
take `database_url` are backend-neutral (tests/integration/test_store_postgres.py runs
them on PostgreSQL too).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from tokenyard.gateway.idempotency import claim_owner, owner_is_dead
from tokenyard.store import Database, Store, migrate


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'state' / 'tokenyard.db'}"


def _dead_owner() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return f"{socket.gethostname()}:{proc.pid}:1"


def test_owner_liveness() -> None:
    assert not owner_is_dead(claim_owner())
    assert owner_is_dead(_dead_owner())
    assert not owner_is_dead("another-host:1:1")  # not ours to judge


def test_a_dead_owner_s_running_claim_is_taken_over(tmp_path: Path) -> None:
    async def scenario() -> list[str]:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'i.db'}")
        store = Store(db)
        outcomes: list[str] = []
        try:
            for key, first_owner in (("dead", _dead_owner()), ("live", claim_owner()),
                                     ("remote", "another-host:1:1")):
                await store.idem_begin("org_a", key, "h", owner=first_owner)
                outcome, _ = await store.idem_begin("org_a", key, "h", owner=claim_owner(),
                                                    owner_is_dead=owner_is_dead)
                outcomes.append(outcome)
            # The new claim is a claim like any other: the next retry waits for it.
            outcomes.append((await store.idem_begin("org_a", "dead", "h",
                                                    owner=claim_owner(),
                                                    owner_is_dead=owner_is_dead))[0])
        finally:
            await db.close()
        return outcomes

    assert asyncio.run(scenario()) == ["new", "running", "running", "running"]


CHAT, MESSAGES = "POST /v1/chat/completions", "POST /v1/messages"


def test_a_record_is_its_api_key_s_and_its_route_s(database_url: str) -> None:
    async def scenario() -> None:
        db = await Database.open(database_url)
        store = Store(db)
        try:
            async def begin(key_id: str, body_hash: str = "h", route: str = CHAT) -> str:
                outcome, _ = await store.idem_begin("org_a", "k", body_hash,
                                                    api_key_id=key_id, route=route)
                return outcome

            assert await begin("key_a") == "new"
            assert await store.idem_complete("org_a", "k", 200, {}, b"A's body",
                                             api_key_id="key_a")
            # Another key of the org: a claim of its own, not A's replay.
            assert await begin("key_b") == "new"
            assert await begin("key_b") == "running"
            assert await store.idem_release("org_a", "k", api_key_id="key_b")
            # A's record holds its route: the same bytes on another route are a mismatch.
            outcome, record = await store.idem_begin("org_a", "k", "h", api_key_id="key_a",
                                                     route=MESSAGES)
            assert outcome == "mismatch" and record is not None and record.route == CHAT
            outcome, record = await store.idem_begin("org_a", "k", "h", api_key_id="key_a",
                                                     route=CHAT)
            assert outcome == "replay" and record is not None
            assert (record.api_key_id, record.body) == ("key_a", b"A's body")
            # Releasing or completing is the claiming key's alone.
            assert await begin("key_c") == "new"
            assert not await store.idem_release("org_a", "k", api_key_id="key_a")
            assert not await store.idem_complete("org_a", "k", 200, {}, b"x",
                                                 api_key_id="key_b")
            assert await begin("key_c") == "running"
        finally:
            await db.close()

    asyncio.run(scenario())


def test_0008_makes_the_records_per_key_and_route_and_back(database_url: str) -> None:
    """A database at 0007 with a record in it, upgraded to head and down again: the
    records of before (which name no key) go, the new columns come and go."""
    now = datetime(2026, 11, 26, tzinfo=UTC)

    async def columns(db: Database) -> list[str]:
        async with db.engine.connect() as conn:
            return await conn.run_sync(lambda sync: [
                c["name"] for c in inspect(sync).get_columns("idempotency_records")])

    async def count(db: Database) -> int:
        async with db.engine.connect() as conn:
            return int((await conn.execute(
                text("SELECT count(*) FROM idempotency_records"))).scalar_one())

    async def main() -> None:
        db = await Database.open(database_url, upgrade=False)
        try:
            await migrate.upgrade(db.engine, "0007")
            async with db.engine.begin() as conn:
                await conn.execute(text(
                    "INSERT INTO idempotency_records (org_id, key, body_hash, state, "
                    "created_at, expires_at) VALUES ('org_a', 'k', 'h', 'running', :t, :t)"),
                    {"t": now})
            await migrate.upgrade(db.engine)
            assert {"api_key_id", "route"} <= set(await columns(db))
            assert await count(db) == 0
            store = Store(db)
            for key_id in ("key_a", "key_b"):  # one Idempotency-Key, two API keys' records
                assert (await store.idem_begin("org_a", "k", "h", api_key_id=key_id,
                                               route=CHAT))[0] == "new"
            assert await count(db) == 2
            await migrate.downgrade(db.engine, "0007")
            assert not {"api_key_id", "route"} & set(await columns(db))
            assert await count(db) == 0
        finally:
            await db.close()

    asyncio.run(main())
