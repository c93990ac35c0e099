"""Users and budgets in the store (0009), on SQLite here and on PostgreSQL in
tests/integration/test_store_postgres.py (the tests that take `database_url`)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from sqlalchemy import text

from tests.unit.test_store import FakeClock, database_url, insert_usage, run, usage
from tokenyard.store import Database, Store, migrate
from tokenyard.store.keys import hash_secret
from tokenyard.store.records import Budget

__all__ = ["database_url"]  # the fixture, imported for this module's tests


def test_users_their_keys_and_budgets_reach_find_key(database_url: str) -> None:
    async def scenario(store: Store) -> None:
        org, other = await store.create_org("acme"), await store.create_org("other")
        project = await store.create_project(org.id, "web")
        ada = await store.create_user(org.id, "ada@acme.test", name="Ada",
                                      project_id=project.id, budget=Budget(5, None))
        with pytest.raises(ValueError, match="already has a user"):
            await store.create_user(org.id, "ada@acme.test")
        await store.create_user(other.id, "ada@acme.test")  # another org's user: fine
        with pytest.raises(LookupError):
            await store.create_user(other.id, "bo@acme.test", project_id=project.id)
        with pytest.raises(LookupError):
            await store.create_user("org_nope", "bo@acme.test")
        with pytest.raises(LookupError):  # a key of a user of another org
            await store.create_api_key(other.id, name="k", user_id=ada.id)
        secret, key = await store.create_api_key(org.id, name="k", user_id=ada.id,
                                                 budget=Budget(None, 70))
        assert key.budget == Budget(None, 70)
        assert [u.id for u in await store.list_users(org.id)] == [ada.id]
        assert (await store.get_user(ada.id)) == ada

        found = await store.find_key(secret)
        assert found is not None and found.user_id == ada.id
        assert (found.key_budget, found.user_budget) == (Budget(None, 70), Budget(5, None))
        assert await store.set_budget("user", ada.id, Budget(9, 90))
        assert await store.set_budget("key", key.id, Budget())
        assert not await store.set_budget("key", "key_nope", Budget(1, 1))
        found = await store.find_key(secret)
        assert found is not None and (found.key_budget, found.user_budget) == (
            Budget(), Budget(9, 90))
        assert not found.key_budget and found.user_budget

    run(database_url, scenario)


def test_a_subjects_spend_is_its_month_and_its_all_time(database_url: str) -> None:
    clock = FakeClock(datetime(2025, 6, 15, tzinfo=UTC))

    async def scenario(store: Store) -> None:
        org = await store.create_org("acme")
        user = await store.create_user(org.id, "ada@acme.test")
        _, key = await store.create_api_key(org.id, name="k", user_id=user.id)
        _, other = await store.create_api_key(org.id, name="other")
        await insert_usage(store, [
            usage("r1", org.id, datetime(2025, 5, 31, 23, tzinfo=UTC), 100, key_id=key.id,
                  user_id=user.id),
            usage("r2", org.id, datetime(2025, 6, 1, tzinfo=UTC), 20, key_id=key.id,
                  user_id=user.id),
            usage("r3", org.id, datetime(2025, 6, 30, 23, tzinfo=UTC), 3, key_id=other.id),
            usage("r4", org.id, datetime(2025, 7, 1, tzinfo=UTC), 4000, key_id=key.id,
                  user_id=user.id),
        ])
        assert await store.spend_of("key", key.id) == (20, 4120)
        assert await store.spend_of("user", user.id) == (20, 4120)
        assert await store.spend_of("key", other.id) == (3, 3)
        assert await store.spend_of("user", "user_nobody") == (0, 0)
        rows = {row.group: row.cost_micros for row in await store.usage_report("user")}
        assert rows == {None: 3, user.id: 4120}

    run(database_url, scenario, clock)


def test_0009_adds_users_budgets_and_attribution_and_goes_back(database_url: str) -> None:
    """A database of 0008 with a key in it, upgraded to head (the key has no user and no
    budget) and back to 0008."""
    secret = "sk-ty-" + "u" * 43

    async def main() -> None:
        db = await Database.open(database_url, upgrade=False)
        try:
            await migrate.upgrade(db.engine, "0008")
            async with db.engine.begin() as conn:
                for statement, values in (
                    ("INSERT INTO orgs (id, name, created_at) VALUES ('org_a', 'a', :t)", {}),
                    ("INSERT INTO api_keys (id, org_id, name, prefix, secret_hash, scopes, "
                     "created_at) VALUES ('key_a', 'org_a', 'k', 'sk-ty-uuuu', :h, '{}', :t)",
                     {"h": hash_secret(secret)}),
                ):
                    await conn.execute(text(statement), {"t": datetime.now(UTC), **values})
            await migrate.upgrade(db.engine)
            found = await Store(db).find_key(secret)
            assert found is not None and found.user_id is None
            assert not found.key_budget and not found.user_budget
            await migrate.downgrade(db.engine, "0008")
            async with db.engine.connect() as conn:
                assert (await conn.execute(text("SELECT id FROM api_keys"))).all() == [
                    ("key_a",)]
        finally:
            await db.close()

    asyncio.run(main())
