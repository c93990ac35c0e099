"""A backing service that fails is a 503 with retry-after, never a 500 (real failures: a
Redis port nobody listens on, a database without its tables)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tokenyard.errors import APIError
from tokenyard.gateway.billing import FLUSH_WAIT_S, Billing
from tokenyard.gateway.gate import Gateway
from tokenyard.gateway.limits import InProcessLimiter
from tokenyard.gateway.redis_limits import RedisLimiter
from tokenyard.store import (
    Database,
    KeyContext,
    LedgerWriter,
    Limits,
    Scopes,
    Store,
    UsageRecord,
)
from tokenyard.store.records import Budget
from tokenyard.telemetry.timeline import Timeline


def test_a_dead_redis_refuses_with_503_and_takes_nothing(tmp_path: Path) -> None:
    async def scenario() -> APIError:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'g.db'}")
        store = Store(db)
        org = await store.create_org("acme")
        secret, _ = await store.create_api_key(org.id, name="k", rpm=10)
        ledger = LedgerWriter(db, tmp_path / "journal")
        await ledger.start()
        gateway = Gateway(store, RedisLimiter("redis://127.0.0.1:1/0"), Billing(store, ledger))
        try:
            key = await gateway.authenticate({"authorization": f"Bearer {secret}"}, Timeline())
            assert key.key_limits == Limits(rpm=10)
            with pytest.raises(APIError) as refused:
                await gateway.admit(key, model="m", endpoint="/v1/chat/completions",
                                    request_id="r1", prompt_tokens=5, max_tokens=5,
                                    timeline=Timeline())
            return refused.value
        finally:
            await gateway.close()

    err = asyncio.run(scenario())
    assert err.status == 503 and err.headers["retry-after"] == "1"
    assert "rate limiter" in err.message


def test_a_dead_redis_holding_money_refuses_with_503_and_frees_the_limits(
        tmp_path: Path) -> None:
    """Money held in Redis (a key with a budget) while Redis is unreachable: 503 with
    retry-after, and the request's rate-limit admission is given back."""
    from tokenyard.gateway.redis_money import RedisMoney

    async def scenario() -> tuple[APIError, int]:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'g.db'}")
        store = Store(db)
        org = await store.create_org("acme")
        secret, _ = await store.create_api_key(org.id, name="k", max_concurrency=1,
                                                budget=Budget(total_micros=1_000))
        ledger = LedgerWriter(db, tmp_path / "journal")
        await ledger.start()
        gateway = Gateway(store, InProcessLimiter(), Billing(
            store, ledger, shared=RedisMoney("redis://127.0.0.1:1/0")))
        try:
            key = await gateway.authenticate({"authorization": f"Bearer {secret}"}, Timeline())
            with pytest.raises(APIError) as refused:
                await gateway.admit(key, model="m", endpoint="/v1/chat/completions",
                                    request_id="r1", prompt_tokens=5, max_tokens=5,
                                    timeline=Timeline())
            return refused.value, gateway.admissions_open
        finally:
            await gateway.close()

    err, admissions_open = asyncio.run(scenario())
    assert err.status == 503 and err.headers["retry-after"] == "1"
    assert "billing" in err.message and admissions_open == 0


def test_a_broken_store_fails_authentication_with_503(tmp_path: Path) -> None:
    async def scenario() -> APIError:
        # A database that was never migrated: every query fails for real.
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}", upgrade=False)
        store = Store(db)
        gateway = Gateway(store, InProcessLimiter(),
                          Billing(store, LedgerWriter(db, tmp_path / "journal")))
        try:
            with pytest.raises(APIError) as refused:
                await gateway.authenticate({"x-api-key": "sk-ty-whatever"}, Timeline())
            return refused.value
        finally:
            await db.close()

    err = asyncio.run(scenario())
    assert err.status == 503 and "key store" in err.message


def test_a_billing_precheck_does_not_hang_on_a_database_that_is_down(tmp_path: Path) -> None:
    async def scenario() -> None:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}", upgrade=False)
        store = Store(db)
        ledger = LedgerWriter(db, tmp_path / "journal", flush_interval=0.01)
        await ledger.start()
        # A settled row the broken database cannot take: a flush would wait for ever.
        ledger.append(UsageRecord(request_id="r1", org_id="org_x", model="m",
                                  endpoint="/v1/chat/completions", status="completed",
                                  prompt_tokens=3, output_tokens=2))
        key = KeyContext(key_id="key_x", key_name="k", prefix="sk-ty-x", org_id="org_x",
                         project_id=None, user_id=None, scopes=Scopes(), key_limits=Limits(),
                         org_limits=Limits(), expires_at=None, revoked_at=None,
                         free_tier_daily_requests=None)
        try:
            # Unbounded, the refresh would wait on the flush for ever (wait_for raises).
            await asyncio.wait_for(Billing(store, ledger).precheck(key), 5 * FLUSH_WAIT_S)
        finally:
            await ledger.close(timeout=0.1)
            await db.close()

    asyncio.run(scenario())
