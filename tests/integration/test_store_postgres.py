"""The store and ledger tests again, on PostgreSQL (asyncpg) instead of SQLite.

The module creates a database of its own, `tokenyard_test_<random>`, drops it at the
end, and empties it before each test. The server is TOKENYARD_TEST_POSTGRES (host:port,
default 127.0.0.1:5432), with trust auth for `postgres` or `root`. Skipped when no
PostgreSQL answers there; failed instead when CI is set.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Iterator

import asyncpg
import pytest

from tests.conftest import require_service

# The backend-neutral tests: collected here too, where `database_url` is PostgreSQL's.
from tests.unit.test_background_store import (  # noqa: F401
    test_claims_leases_writes_and_one_outcome,
)
from tests.unit.test_batch_store import (  # noqa: F401
    test_claims_leases_results_and_ending_once,
)
from tests.unit.test_conversations_store import (  # noqa: F401
    test_racing_appends_all_land_and_other_orgs_see_nothing,
)
from tests.unit.test_idempotency_owner import (  # noqa: F401
    test_0008_makes_the_records_per_key_and_route_and_back,
    test_a_record_is_its_api_key_s_and_its_route_s,
)
from tests.unit.test_ledger import (  # noqa: F401
    test_a_failed_flush_keeps_the_records_and_retries,
    test_a_live_writers_journal_is_not_replayed_by_another_writer,
    test_a_thousand_appends_all_land_and_balances_drop_by_exactly_their_sum,
    test_close_with_the_database_down_leaves_the_records_in_the_journal,
    test_kill_9_before_any_flush_loses_no_appended_record,
    test_replaying_a_journal_twice_inserts_and_bills_nothing_twice,
    test_rows_of_one_batch_are_written_in_the_order_they_were_settled,
)
from tests.unit.test_request_records import (  # noqa: F401
    test_a_record_is_found_at_once_then_from_the_store_by_its_org_only,
    test_captured_bodies_are_redacted_cut_and_shown_to_the_owning_org,
    test_the_purge_job_deletes_old_records_and_expired_captures,
)
from tests.unit.test_responses_store import (  # noqa: F401
    test_a_chain_expands_oldest_turn_first_inputs_before_outputs,
    test_a_saved_response_is_read_back_by_its_org_and_by_admins_only,
    test_an_expired_response_is_not_served_and_the_purge_deletes_only_it,
    test_delete_is_org_scoped_and_happens_once,
)
from tests.unit.test_store import (  # noqa: F401
    test_0002_keeps_rows_gives_them_normal_priority_and_drops_the_cache_write_price,
    test_a_key_s_priority_is_its_own_else_its_org_s,
    test_downgrade_base_drops_every_table_and_upgrade_restores_them,
    test_first_start_creates_the_default_org_and_admin_key_once,
    test_idempotency_new_running_replay_mismatch_and_release,
    test_key_expires_at_its_expiry_time,
    test_key_for_a_project_of_another_org_is_refused,
    test_key_is_found_by_its_secret_and_refused_once_revoked,
    test_limits_are_replaced_and_seen_by_find_key,
    test_migrations_create_every_table_exactly_as_tables_py_declares,
    test_month_spend_and_requests_today_count_only_their_period,
    test_prices_balances_and_spend_caps,
    test_scopes_round_trip_through_the_json_column,
    test_secret_is_stored_only_as_its_sha256,
    test_twenty_concurrent_begins_with_one_key_give_exactly_one_new,
    test_usage_report_sums_equal_the_inserted_rows_for_every_grouping,
)
from tests.unit.test_users_store import (  # noqa: F401
    test_0009_adds_users_budgets_and_attribution_and_goes_back,
    test_a_subjects_spend_is_its_month_and_its_all_time,
    test_users_their_keys_and_budgets_reach_find_key,
)

SERVER = os.environ.get("TOKENYARD_TEST_POSTGRES", "").strip() or "127.0.0.1:5432"
ADMIN_USERS = ("postgres", "root")  # trust auth; whichever role exists


async def _admin_dsn() -> str | None:
    for user in ADMIN_USERS:
        dsn = f"postgresql://{user}@{SERVER}/postgres"
        try:
            conn = await asyncpg.connect(dsn, timeout=3)
        except (OSError, asyncpg.PostgresError, TimeoutError):
            continue
        await conn.close()
        return dsn
    return None


async def _admin(dsn: str, statement: str) -> None:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def postgres_admin_dsn() -> str:
    dsn = asyncio.run(_admin_dsn())
    require_service("PostgreSQL", dsn is not None,
                    f"it is unreachable on {SERVER} as {' or '.join(ADMIN_USERS)}")
    assert dsn is not None
    return dsn


@pytest.fixture(scope="module")
def postgres_database(postgres_admin_dsn: str) -> Iterator[str]:
    """A database of this module's own, as a `postgresql://` URL; dropped at the end."""
    name = f"tokenyard_test_{secrets.token_hex(6)}"
    asyncio.run(_admin(postgres_admin_dsn, f'CREATE DATABASE "{name}"'))
    try:
        yield postgres_admin_dsn.rsplit("/", 1)[0] + f"/{name}"
    finally:
        # FORCE: a test that failed midway may have left a connection open.
        asyncio.run(_admin(postgres_admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def database_url(postgres_database: str) -> str:
    """The module's database, emptied: each test starts from an unmigrated database.

    Recreating the schema is much cheaper than CREATE/DROP DATABASE (which checkpoint).
    """
    asyncio.run(_admin(postgres_database, "DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    return postgres_database
