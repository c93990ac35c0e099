"""A backing service that fails is a 503 with retry-after, never a 500 (real failures: a
Redis port nobody listens on, a database without its tables)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tokenyard.api.errors import APIError
from tokenyard.gateway.billing import Billing
from tokenyard.gateway.limits import InProcessLimiter
from tokenyard.gateway.pipeline import Gateway
from tokenyard.gateway.redis_limits import RedisLimiter
from tokenyard.store import Database, LedgerWriter, Limits, Store
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
