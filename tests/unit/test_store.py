"""The store on SQLite: migrations, keys, prices and money, reports, idempotency.

Tests that take `database_url` are backend-neutral: tests/integration/test_store_postgres.py
runs them again on PostgreSQL by importing them beside its own `database_url` fixture.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, select, text

from tokenyard.store import (
    Database,
    Prices,
    Scopes,
    Store,
    UsageRecord,
    cost_micros,
    format_money,
    migrate,
    normalize_url,
    parse_money,
)
from tokenyard.store.keys import hash_secret
from tokenyard.store.ledger import commit_usage
from tokenyard.store.records import Limits
from tokenyard.store.repo import DEFAULT_ORG_LIMITS
from tokenyard.store.tables import metadata

T = TypeVar("T")


class FakeClock:
    """A settable aware-UTC clock for Store(clock=...)."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def run(
    url: str,
    scenario: Callable[[Store], Awaitable[T]],
    clock: Callable[[], datetime] | None = None,
) -> T:
    """Open (and migrate) `url`, run `scenario` on a Store over it, close."""

    async def main() -> T:
        db = await Database.open(url)
        try:
            return await scenario(Store(db, clock) if clock else Store(db))
        finally:
            await db.close()

    return asyncio.run(main())


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'state' / 'tokenyard.db'}"


# -- migrations ------------------------------------------------------------------------


def test_migrations_create_every_table_exactly_as_tables_py_declares(database_url: str) -> None:
    async def scenario(store: Store) -> tuple[set[str], list[Any]]:
        async with store.db.engine.connect() as conn:
            names = await conn.run_sync(lambda sync: set(inspect(sync).get_table_names()))
            diff = await conn.run_sync(
                lambda sync: compare_metadata(
                    MigrationContext.configure(sync, opts={"compare_type": True}), metadata
                )
            )
        return names, diff

    names, diff = run(database_url, scenario)
    assert names == set(metadata.tables) | {"alembic_version"}
    assert diff == []  # columns, types, indexes, constraints: migration == tables.py


def test_downgrade_base_drops_every_table_and_upgrade_restores_them(database_url: str) -> None:
    async def tables(store: Store) -> set[str]:
        async with store.db.engine.connect() as conn:
            return await conn.run_sync(lambda sync: set(inspect(sync).get_table_names()))

    async def scenario(store: Store) -> tuple[set[str], set[str]]:
        await migrate.downgrade(store.db.engine, "base")
        after_down = await tables(store)
        await migrate.upgrade(store.db.engine)
        return after_down, await tables(store)

    after_down, after_up = run(database_url, scenario)
    assert after_down <= {"alembic_version"}
    assert after_up == set(metadata.tables) | {"alembic_version"}


def test_0002_keeps_rows_gives_them_normal_priority_and_drops_the_cache_write_price(
    database_url: str,
) -> None:
    """A database made by 0001, with rows in it, upgraded to head and back."""
    secret = "sk-ty-" + "m" * 43

    async def main() -> None:
        db = await Database.open(database_url, upgrade=False)
        try:
            await migrate.upgrade(db.engine, "0001")
            now = datetime(2025, 1, 1, tzinfo=UTC)
            async with db.engine.begin() as conn:
                for statement, values in (
                    ("INSERT INTO orgs (id, name, created_at) VALUES ('org_a', 'a', :t)", {}),
                    ("INSERT INTO api_keys (id, org_id, name, prefix, secret_hash, scopes, "
                     "created_at) VALUES ('key_a', 'org_a', 'k', 'sk-ty-mmmm', :h, '{}', :t)",
                     {"h": hash_secret(secret)}),
                    ("INSERT INTO model_prices VALUES ('m', 1, 2, 3, 4)", {}),
                    ("INSERT INTO usage_ledger (request_id, created_at, day, org_id, model, "
                     "endpoint, status, prompt_tokens, cached_tokens, cache_write_tokens, "
                     "output_tokens, cost_micros) VALUES ('r1', :t, '2025-01-01', 'org_a', 'm', "
                     "'/v1/chat/completions', 'completed', 10, 2, 0, 5, 77)", {}),
                ):
                    await conn.execute(text(statement), {"t": now, **values})
            await migrate.upgrade(db.engine)
            store = Store(db)
            found = await store.find_key(secret)
            assert found is not None and found.priority == 0
            assert (await store.list_keys())[0].priority is None  # follows its org
            assert (await store.get_org("org_a")).priority == 0  # type: ignore[union-attr]
            assert await store.prices() == {"m": Prices(input=1, cached_input=2, output=4)}
            [row] = await store.usage_report("org")
            assert (row.prompt_tokens, row.cached_tokens, row.output_tokens,
                    row.cost_micros) == (10, 2, 5, 77)
            await migrate.downgrade(db.engine, "0001")
            async with db.engine.connect() as conn:
                price = (await conn.execute(text(
                    "SELECT input, cached_input, cache_write, output FROM model_prices"
                ))).one()
            assert tuple(price) == (1, 2, 0, 4)  # the column is back, at zero
        finally:
            await db.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("postgres://u:p@h:5432/db", "postgresql+asyncpg://u:p@h:5432/db"),
        ("sqlite:///x.db", "sqlite+aiosqlite:///x.db"),
        ("sqlite:////abs/x.db", "sqlite+aiosqlite:////abs/x.db"),
        ("postgresql+asyncpg://h/db", "postgresql+asyncpg://h/db"),
        ("sqlite+aiosqlite:///x.db", "sqlite+aiosqlite:///x.db"),
    ],
)
def test_normalize_url_picks_the_async_driver(url: str, expected: str) -> None:
    assert normalize_url(url) == expected


def test_open_sqlite_creates_the_directory_and_turns_on_wal(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "t.db"

    async def scenario(store: Store) -> tuple[str, int]:
        async with store.db.engine.connect() as conn:
            mode = (await conn.execute(text("PRAGMA journal_mode"))).scalar_one()
            timeout = (await conn.execute(text("PRAGMA busy_timeout"))).scalar_one()
        return mode, timeout

    mode, timeout = run(f"sqlite:///{path}", scenario)
    assert path.is_file()
    assert mode == "wal"
    assert timeout > 0


# -- keys ------------------------------------------------------------------------------


def test_key_is_found_by_its_secret_and_refused_once_revoked(database_url: str) -> None:
    async def scenario(store: Store) -> None:
        org = await store.create_org("acme", rpm=600, tpm=100_000, free_tier_daily_requests=50)
        project = await store.create_project(org.id, "web")
        user = await store.create_user(org.id, "a@acme.test")
        secret, key = await store.create_api_key(
            org.id,
            name="ci",
            project_id=project.id,
            user_id=user.id,
            rpm=60,
            max_concurrency=4,
        )
        assert secret.startswith("sk-ty-") and len(secret) == len("sk-ty-") + 43
        assert key.prefix == secret[:10] and key.id.startswith("key_")
        found = await store.find_key(secret)
        assert found is not None
        assert (found.key_id, found.org_id, found.project_id, found.user_id) == (
            key.id,
            org.id,
            project.id,
            user.id,
        )
        assert (found.key_name, found.prefix) == ("ci", key.prefix)
        assert (found.key_limits.rpm, found.key_limits.tpm, found.key_limits.max_concurrency) == (
            60,
            None,
            4,
        )
        assert (found.org_limits.rpm, found.org_limits.tpm) == (600, 100_000)
        assert found.free_tier_daily_requests == 50
        assert found.is_active(store.clock())
        assert await store.find_key(secret + "x") is None
        assert await store.find_key("sk-ty-" + "A" * 43) is None

        assert await store.revoke_key(key.id)
        assert not await store.revoke_key(key.id)  # already revoked: keeps the first time
        revoked = await store.find_key(secret)
        assert revoked is not None and revoked.revoked_at is not None
        assert not revoked.is_active(store.clock())
        listed = await store.list_keys(org.id)
        assert [k.id for k in listed] == [key.id] and listed[0].revoked_at is not None

    run(database_url, scenario)


def test_key_expires_at_its_expiry_time(database_url: str) -> None:
    clock = FakeClock(datetime(2025, 3, 1, 12, 0, tzinfo=UTC))

    async def scenario(store: Store) -> None:
        org = await store.create_org("acme")
        expires = clock.now + timedelta(hours=1)
        secret, _ = await store.create_api_key(org.id, name="temp", expires_at=expires)
        found = await store.find_key(secret)
        assert found is not None and found.expires_at == expires
        assert found.expires_at.tzinfo is not None  # aware UTC on every backend
        assert found.is_active(clock.now)
        assert not found.is_active(expires)
        assert not found.is_active(expires + timedelta(seconds=1))

    run(database_url, scenario, clock)


def test_secret_is_stored_only_as_its_sha256(database_url: str) -> None:
    async def scenario(store: Store) -> tuple[str, list[str]]:
        org = await store.create_org("acme")
        secret, _ = await store.create_api_key(org.id, name="k")
        default_secret = await store.ensure_default_org()
        assert default_secret is None  # an org already exists
        dumped = []
        async with store.db.engine.connect() as conn:
            for table in metadata.sorted_tables:
                dumped += [repr(tuple(row)) for row in await conn.execute(select(table))]
        return secret, dumped

    secret, dumped = run(database_url, scenario)
    import hashlib

    assert not any(secret in row or secret[10:] in row for row in dumped)
    assert any(hashlib.sha256(secret.encode()).hexdigest() in row for row in dumped)


def test_scopes_round_trip_through_the_json_column(database_url: str) -> None:
    scopes = Scopes(models=("llama-*", "smollm2"), max_context_tokens=8192, admin=True)

    async def scenario(store: Store) -> None:
        org = await store.create_org("acme")
        secret, _ = await store.create_api_key(org.id, name="k", scopes=scopes)
        found = await store.find_key(secret)
        assert found is not None and found.scopes == scopes
        assert (await store.list_keys())[0].scopes == scopes
        assert found.scopes.allows_model("llama-3-8b") and not found.scopes.allows_model("qwen")
        _, open_key = await store.create_api_key(org.id, name="all")
        assert open_key.scopes == Scopes() and open_key.scopes.allows_model("anything")

    run(database_url, scenario)


def test_key_for_a_project_of_another_org_is_refused(database_url: str) -> None:
    async def scenario(store: Store) -> None:
        mine, theirs = await store.create_org("mine"), await store.create_org("theirs")
        their_project = await store.create_project(theirs.id, "p")
        with pytest.raises(LookupError):
            await store.create_api_key(mine.id, name="k", project_id=their_project.id)
        with pytest.raises(LookupError):
            await store.create_api_key("org_missing", name="k")
        with pytest.raises(LookupError):
            await store.create_project("org_missing", "p")

    run(database_url, scenario)


def test_limits_are_replaced_and_seen_by_find_key(database_url: str) -> None:
    async def scenario(store: Store) -> None:
        org = await store.create_org("acme")
        secret, key = await store.create_api_key(org.id, name="k", rpm=1)
        assert await store.set_key_limits(key.id, tpm=500, max_concurrency=2)
        assert await store.set_org_limits(org.id, rpm=100, free_tier_daily_requests=10)
        assert not await store.set_key_limits("key_missing", rpm=1)
        found = await store.find_key(secret)
        assert found is not None
        assert (found.key_limits.rpm, found.key_limits.tpm, found.key_limits.max_concurrency) == (
            None,
            500,
            2,
        )
        assert found.org_limits.rpm == 100 and found.free_tier_daily_requests == 10

    run(database_url, scenario)


def test_a_key_s_priority_is_its_own_else_its_org_s(database_url: str) -> None:
    async def scenario(store: Store) -> None:
        org = await store.create_org("acme", priority=1)
        follows, key = await store.create_api_key(org.id, name="follows")
        own, _ = await store.create_api_key(org.id, name="own", priority=-1)
        assert key.priority is None

        async def priorities() -> tuple[int, int]:
            a, b = await store.find_key(follows), await store.find_key(own)
            assert a is not None and b is not None
            return a.priority, b.priority

        assert await priorities() == (1, -1)
        assert await store.set_org_priority(org.id, 0)
        assert await priorities() == (0, -1)
        assert await store.set_key_priority(key.id, 1)
        assert await priorities() == (1, -1)
        assert await store.set_key_priority(key.id, None)  # back to the org's
        assert await priorities() == (0, -1)
        assert not await store.set_key_priority("key_missing", 0)
        assert not await store.set_org_priority("org_missing", 0)
        assert (await store.get_org(org.id)).priority == 0  # type: ignore[union-attr]

    run(database_url, scenario)


def test_first_start_creates_the_default_org_and_admin_key_once(database_url: str) -> None:
    async def scenario(store: Store) -> None:
        secret = await store.ensure_default_org()
        assert secret is not None
        assert await store.ensure_default_org() is None
        found = await store.find_key(secret)
        assert found is not None and found.scopes.admin and found.project_id is not None
        # Generous limits, but limits: the limiter runs from the first request.
        assert found.org_limits == DEFAULT_ORG_LIMITS
        assert None not in (DEFAULT_ORG_LIMITS.rpm, DEFAULT_ORG_LIMITS.tpm,
                            DEFAULT_ORG_LIMITS.max_concurrency)
        assert found.key_limits == Limits() and found.priority == 0
        assert [org.name for org in await store.list_orgs()] == ["default"]
        assert [p.name for p in await store.list_projects(found.org_id)] == ["default"]

    run(database_url, scenario)


# -- money -----------------------------------------------------------------------------

PRICES = Prices(input=150_000, cached_input=75_000, output=600_000)


@pytest.mark.parametrize(
    ("prices", "counts", "expected"),
    [
        (PRICES, (0, 0, 0), 0),
        (PRICES, (1_000_000, 0, 0), 150_000),  # exactly the per-million price
        (PRICES, (1000, 0, 0), 150),
        (PRICES, (1, 0, 0), 0),  # 0.15 micro rounds down
        (PRICES, (0, 0, 1), 1),  # 0.6 micro rounds up
        (Prices(input=500_000), (1, 0, 0), 1),  # exactly 0.5 rounds half up
        (Prices(input=1_500_000), (1, 0, 0), 2),  # 1.5 -> 2
        (Prices(input=499_999), (1, 0, 0), 0),
        # Summed before rounding: three 0.6-micro parts are 1.8 -> 2, not 3 x 1 = 3.
        (Prices(600_000, 600_000, 600_000), (1, 1, 1), 2),
        (
            PRICES,
            (1234, 5678, 2345),
            (1234 * 150_000 + 5678 * 75_000 + 2345 * 600_000 + 500_000) // 1_000_000,
        ),
        (Prices(output=60_000_000), (0, 0, 10**9), 60_000_000_000),  # no float drift
    ],
)
def test_cost_is_exact_integer_arithmetic_rounded_half_up_once(
    prices: Prices, counts: tuple[int, int, int], expected: int
) -> None:
    assert cost_micros(prices, *counts) == expected


def test_cost_rejects_negative_token_counts() -> None:
    with pytest.raises(ValueError):
        cost_micros(PRICES, -1, 0, 0)


@pytest.mark.parametrize(
    ("text_", "micros"),
    [("12.50", 12_500_000), ("0.000001", 1), ("3", 3_000_000), ("-1.25", -1_250_000)],
)
def test_money_parses_and_formats_in_micros(text_: str, micros: int) -> None:
    assert parse_money(text_) == micros
    assert parse_money(format_money(micros)) == micros
    assert format_money(12_500_000) == "12.500000"


@pytest.mark.parametrize("bad", ["0.0000001", "abc", "", "NaN", "inf"])
def test_money_refuses_amounts_it_cannot_hold_exactly(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_money(bad)


def test_prices_balances_and_spend_caps(database_url: str) -> None:
    async def scenario(store: Store) -> None:
        version = store.prices_version
        await store.set_price("m", input=1, cached_input=2, output=4)
        await store.set_price("m", input=10, cached_input=20, output=40)
        assert await store.prices() == {"m": Prices(10, 20, 40)}
        assert store.prices_version == version + 2  # what billing's price cache watches

        prepaid = await store.create_org("prepaid", balance_micros=5_000_000)
        postpaid = await store.create_org("postpaid")
        assert await store.balance(prepaid.id) == 5_000_000
        assert await store.balance(postpaid.id) is None
        assert await store.add_credit(prepaid.id, 250) == 5_000_250
        assert await store.add_credit(postpaid.id, 7) == 7  # now prepaid
        assert await store.balance(postpaid.id) == 7
        with pytest.raises(LookupError):
            await store.add_credit("org_missing", 1)

        project = await store.create_project(prepaid.id, "p")
        await store.set_spend_cap(prepaid.id, None, 100)
        await store.set_spend_cap(prepaid.id, None, 200)  # replaces, never duplicates
        await store.set_spend_cap(prepaid.id, project.id, 50)
        caps = {(c.org_id, c.project_id): c.cap_micros for c in await store.spend_caps()}
        assert caps == {(prepaid.id, None): 200, (prepaid.id, project.id): 50}
        await store.set_spend_cap(prepaid.id, None, None)
        assert [(c.project_id, c.cap_micros) for c in await store.spend_caps(prepaid.id)] == [
            (project.id, 50)
        ]

    run(database_url, scenario)


# -- usage -----------------------------------------------------------------------------


def usage(
    request_id: str, org_id: str, created_at: datetime, cost: int = 0, **fields: Any
) -> UsageRecord:
    """A ledger record with a few defaults."""
    values: dict[str, Any] = {
        "model": "m",
        "endpoint": "/v1/chat/completions",
        "status": "completed",
        "prompt_tokens": 10,
    }
    values.update(fields)
    return UsageRecord(
        request_id=request_id, org_id=org_id, created_at=created_at, cost_micros=cost, **values
    )


async def insert_usage(store: Store, records: list[UsageRecord]) -> None:
    async with store.db.engine.begin() as conn:
        await commit_usage(conn, records)


def test_month_spend_and_requests_today_count_only_their_period(database_url: str) -> None:
    clock = FakeClock(datetime(2025, 3, 15, 9, 0, tzinfo=UTC))

    async def scenario(store: Store) -> None:
        org = await store.create_org("acme")
        other = await store.create_org("other")
        project = await store.create_project(org.id, "p")
        today = clock.now
        await insert_usage(
            store,
            [
                usage("r1", org.id, today, 100, project_id=project.id),
                usage("r2", org.id, today - timedelta(days=14), 20),  # March 1st
                usage("r3", org.id, datetime(2025, 2, 28, 23, 59, tzinfo=UTC), 1000),  # February
                usage("r4", org.id, datetime(2025, 4, 1, tzinfo=UTC), 1000),  # April
                usage("r5", org.id, today, 3, status="failed"),
                usage("r6", other.id, today, 5000),
            ],
        )
        assert await store.month_spend(org.id) == 123
        assert await store.month_spend(org.id, project.id) == 100
        assert await store.requests_today(org.id) == 1  # failed and other days excluded
        assert await store.requests_today(other.id) == 1

    run(database_url, scenario, clock)


def test_usage_report_sums_equal_the_inserted_rows_for_every_grouping(database_url: str) -> None:
    rng = random.Random(7)

    async def scenario(store: Store) -> None:
        orgs = [await store.create_org(f"org{i}") for i in range(3)]
        projects = {o.id: await store.create_project(o.id, "p") for o in orgs}
        keys = {o.id: (await store.create_api_key(o.id, name="k"))[1] for o in orgs}
        users = {o.id: await store.create_user(o.id, "u@acme.test") for o in orgs}
        start = datetime(2025, 5, 1, tzinfo=UTC)
        records = []
        for i in range(300):
            org = rng.choice(orgs)
            records.append(
                usage(
                    f"req{i}",
                    org.id,
                    start + timedelta(hours=rng.randrange(24 * 5)),
                    rng.randrange(10_000),
                    project_id=projects[org.id].id if rng.random() < 0.7 else None,
                    key_id=keys[org.id].id,
                    user_id=users[org.id].id if rng.random() < 0.5 else None,
                    model=rng.choice(["a", "b", "c"]),
                    prompt_tokens=rng.randrange(5000),
                    cached_tokens=rng.randrange(100),
                    output_tokens=rng.randrange(900),
                )
            )
        await insert_usage(store, records)

        attribute = {"key": "key_id", "user": "user_id", "project": "project_id",
                     "org": "org_id", "model": "model"}
        for group_by in ("key", "user", "project", "org", "model", "day"):
            expected: dict[Any, list[int]] = defaultdict(lambda: [0] * 5)
            for r in records:
                assert r.created_at is not None
                group = (
                    r.created_at.date().isoformat()
                    if group_by == "day"
                    else getattr(r, attribute[group_by])
                )
                sums = expected[group]
                for n, value in enumerate(
                    (
                        1,
                        r.prompt_tokens,
                        r.cached_tokens,
                        r.output_tokens,
                        r.cost_micros,
                    )
                ):
                    sums[n] += value
            report = await store.usage_report(group_by)  # type: ignore[arg-type]
            got = {
                row.group: [
                    row.requests,
                    row.prompt_tokens,
                    row.cached_tokens,
                    row.output_tokens,
                    row.cost_micros,
                ]
                for row in report
            }
            assert got == dict(expected), group_by

        # Filters: one org, one day window [since, until).
        since, until = start + timedelta(days=1), start + timedelta(days=2)
        window = [
            r
            for r in records
            if r.org_id == orgs[0].id and r.created_at is not None and since <= r.created_at < until
        ]
        rows = await store.usage_report("org", since=since, until=until, org_id=orgs[0].id)
        assert [(row.group, row.requests, row.cost_micros) for row in rows] == [
            (orgs[0].id, len(window), sum(r.cost_micros for r in window))
        ]
        with pytest.raises(ValueError):
            await store.usage_report("nope")  # type: ignore[arg-type]

    run(database_url, scenario)


# -- idempotency -----------------------------------------------------------------------


def test_idempotency_new_running_replay_mismatch_and_release(database_url: str) -> None:
    clock = FakeClock(datetime(2025, 1, 1, tzinfo=UTC))

    async def scenario(store: Store) -> None:
        assert await store.idem_begin("org_a", "k1", "hash1") == ("new", None)
        outcome, record = await store.idem_begin("org_a", "k1", "hash1")
        assert outcome == "running" and record is not None and record.state == "running"
        outcome, record = await store.idem_begin("org_a", "k1", "hash2")
        assert outcome == "mismatch"
        assert (await store.idem_begin("org_b", "k1", "hash2"))[0] == "new"  # per org

        body = b'{"id":"chatcmpl-1"}\x00\xff'
        assert await store.idem_complete("org_a", "k1", 200, {"x-request-id": "r1"}, body)
        outcome, record = await store.idem_begin("org_a", "k1", "hash1")
        assert outcome == "replay" and record is not None
        assert (record.status_code, record.headers, record.body) == (
            200,
            {"x-request-id": "r1"},
            body,
        )
        assert (await store.idem_begin("org_a", "k1", "other"))[0] == "mismatch"
        assert not await store.idem_release("org_a", "k1")  # a done record stays

        # A failed request releases its claim: the retry runs anew.
        assert (await store.idem_begin("org_a", "k2", "h"))[0] == "new"
        assert await store.idem_release("org_a", "k2")
        assert (await store.idem_begin("org_a", "k2", "h"))[0] == "new"

        # Expired records count as absent and are replaced.
        clock.advance(86_400)
        assert (await store.idem_begin("org_a", "k1", "hash3"))[0] == "new"

        # A claim held past its lease (its gateway died) is taken over.
        assert (await store.idem_begin("org_a", "k3", "h", running_lease_s=60))[0] == "new"
        clock.advance(30)
        assert (await store.idem_begin("org_a", "k3", "h", running_lease_s=60))[0] == "running"
        clock.advance(31)
        assert (await store.idem_begin("org_a", "k3", "h", running_lease_s=60))[0] == "new"

    run(database_url, scenario, clock)


def test_twenty_concurrent_begins_with_one_key_give_exactly_one_new(database_url: str) -> None:
    async def scenario(store: Store) -> list[str]:
        results = await asyncio.gather(*(store.idem_begin("org_a", "same", "h") for _ in range(20)))
        return [outcome for outcome, _ in results]

    outcomes = run(database_url, scenario)
    assert outcomes.count("new") == 1
    assert outcomes.count("running") == 19
