"""Administration: the operations behind `tokenyard admin` and `/admin/v1`, on SQLite."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from tokenyard.gateway.admin import Admin, AdminError, to_csv, to_table
from tokenyard.gateway.billing import Billing
from tokenyard.store import Database, LedgerWriter, Prices, Store, UsageRecord

T = TypeVar("T")


def run(tmp_path: Path, scenario: Callable[[Admin, Store], Awaitable[T]],
        name: str = "admin.db") -> T:
    async def main() -> T:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / name}")
        try:
            store = Store(db)
            return await scenario(Admin(store), store)
        finally:
            await db.close()

    return asyncio.run(main())


def test_org_key_limits_prices_credit_round_trip(tmp_path: Path) -> None:
    async def scenario(admin: Admin, store: Store) -> None:
        org = await admin.create_org({"name": "acme", "balance": "5", "rpm": 60})
        assert org["balance"] == "5.000000" and org["rpm"] == 60
        key = await admin.create_key({"org_id": org["id"], "name": "ci", "models": "Smol*,x",
                                      "tpm": 1000, "max_context_tokens": 512})
        found = await store.find_key(key["secret"])
        assert found is not None and found.org_id == org["id"]
        assert found.scopes.models == ("Smol*", "x") and found.scopes.max_context_tokens == 512
        assert found.key_limits.tpm == 1000 and found.org_limits.rpm == 60
        assert all("secret" not in k for k in await admin.list_keys(org["id"]))
        await admin.set_key_limits(key["id"], {"rpm": 7})
        assert (await store.find_key(key["secret"])).key_limits.rpm == 7  # type: ignore[union-attr]
        price = await admin.set_price("m", {"input": "0.10", "output": "0.4"})
        assert price == {"model": "m", "input": "0.100000", "cached_input": "0.000000",
                         "output": "0.400000"}  # no cache-write price: nothing charges it
        assert await admin.list_prices() == [price]
        assert (await store.prices())["m"].output == 400_000
        assert (await admin.add_credit(org["id"], {"amount": "2.5"}))["balance"] == "7.500000"
        await admin.revoke_key(key["id"])
        assert (await store.find_key(key["secret"])).revoked_at is not None  # type: ignore[union-attr]

    run(tmp_path, scenario)


def test_a_price_set_through_the_gateway_s_store_bills_its_next_request(
    tmp_path: Path,
) -> None:
    async def scenario(admin: Admin, store: Store) -> tuple[Prices, Prices]:
        # A refresh interval that cannot pass during the test: only the change is seen.
        billing = Billing(store, LedgerWriter(store.db, tmp_path / "journal"),
                          prices_refresh_s=3600)
        before = await billing.prices("m")
        await admin.set_price("m", {"input": "1", "output": "2"})
        return before, await billing.prices("m")

    before, after = run(tmp_path, scenario)
    assert before == Prices() and after == Prices(input=1_000_000, output=2_000_000)


def test_priority_classes_by_name_for_orgs_and_keys(tmp_path: Path) -> None:
    async def scenario(admin: Admin, store: Store) -> None:
        org = await admin.create_org({"name": "acme", "priority": "low"})
        assert org["priority"] == "low"
        plain = await admin.create_key({"org_id": org["id"]})
        urgent = await admin.create_key({"org_id": org["id"], "priority": "high"})
        assert (plain["priority"], urgent["priority"]) == ("org", "high")

        async def priority(key: dict[str, str]) -> int:
            found = await store.find_key(key["secret"])
            assert found is not None
            return found.priority

        assert (await priority(plain), await priority(urgent)) == (1, -1)
        assert await admin.set_org_priority(org["id"], {"priority": "normal"}) == {
            "id": org["id"], "priority": "normal"}
        assert await priority(plain) == 0
        assert (await admin.set_key_priority(urgent["id"], {"priority": "org"}))[
            "priority"] == "org"
        assert await priority(urgent) == 0
        await admin.set_key_priority(plain["id"], {"priority": "LOW"})
        assert await priority(plain) == 1
        assert [k["priority"] for k in await admin.list_keys(org["id"])] == ["low", "org"]
        assert (await admin.create_org({"name": "b"}))["priority"] == "normal"
        for bad in (admin.create_org({"name": "c", "priority": "urgent"}),
                    admin.set_org_priority(org["id"], {"priority": "org"}),
                    admin.set_key_priority(plain["id"], {}),
                    admin.create_key({"org_id": org["id"], "priority": -1})):
            with pytest.raises(AdminError) as refused:
                await bad
            assert refused.value.field == "priority"
        with pytest.raises(AdminError) as missing:
            await admin.set_key_priority("key_none", {"priority": "high"})
        assert missing.value.field == "key_id"

    run(tmp_path, scenario)


def test_bad_arguments_name_the_field(tmp_path: Path) -> None:
    async def scenario(admin: Admin, store: Store) -> list[str | None]:
        org, other = await store.create_org("org"), await store.create_org("other")
        their_project = await store.create_project(other.id, "p")
        fields = []
        for call in (admin.create_org({}), admin.create_org({"name": "x", "rpm": "lots"}),
                     admin.create_org({"name": "x", "balance": "1.2345678"}),
                     admin.create_key({"org_id": "org_missing"}),
                     admin.create_key({"org_id": org.id, "rpm": "lots"}),
                     admin.create_key({"org_id": org.id, "project_id": their_project.id}),
                     admin.usage({"group_by": "colour"}), admin.revoke_key("key_none")):
            try:
                await call
            except AdminError as exc:
                fields.append(exc.field)
        return fields

    assert run(tmp_path, scenario) == ["name", "rpm", "balance", "org_id", "rpm", "project_id",
                                       "group_by", "key_id"]


def test_a_boolean_is_a_json_boolean_or_refused(tmp_path: Path) -> None:
    """`"admin": "false"` once made an admin key (bool("false") is True). Stand-ins for
    a boolean are refused naming the field; a null is "left out" only where that is false."""
    async def scenario(admin: Admin, store: Store) -> None:
        org = await store.create_org("org")
        for value in ("false", "true", 0, 1, "yes", [], {}):
            with pytest.raises(AdminError) as refused:
                await admin.create_key({"org_id": org.id, "admin": value})
            assert refused.value.field == "admin"
            with pytest.raises(AdminError) as refused:
                await admin.set_capture(org.id, {"enabled": value})
            assert refused.value.field == "enabled"
        with pytest.raises(AdminError) as refused:  # null would turn capture on
            await admin.set_capture(org.id, {"enabled": None})
        assert refused.value.field == "enabled"
        assert not (await admin.capture(org.id))["capture"]
        made = [await admin.create_key({"org_id": org.id, "admin": value})
                for value in (None, False, True)]
        assert [k["scopes"]["admin"] for k in made] == [False, False, True]
        assert sorted(k["scopes"]["admin"] for k in await admin.list_keys(org.id)) == [
            False, False, True]

    run(tmp_path, scenario)


def test_usage_report_sums_the_ledger_by_each_dimension(tmp_path: Path) -> None:
    async def scenario(admin: Admin, store: Store) -> dict[str, list[dict[str, object]]]:
        org = await admin.create_org({"name": "acme"})
        writer = LedgerWriter(store.db, tmp_path / "journal")
        await writer.start()
        for i in range(6):
            writer.append(UsageRecord(
                request_id=f"r{i}", org_id=org["id"], model="a" if i % 2 else "b",
                endpoint="/v1/chat/completions", status="completed", prompt_tokens=10,
                cached_tokens=i, output_tokens=5, cost_micros=100 + i,
            ))
        await writer.close()
        return {g: await admin.usage({"group_by": g}) for g in ("model", "org", "day")}

    reports = run(tmp_path, scenario)
    by_model = {r["group"]: r for r in reports["model"]}
    assert by_model["a"]["requests"] == 3 and by_model["a"]["cost_micros"] == 101 + 103 + 105
    assert by_model["b"]["cached_tokens"] == 0 + 2 + 4
    assert reports["org"][0]["requests"] == 6 and reports["org"][0]["cost"] == "0.000615"
    assert len(reports["day"]) == 1 and reports["day"][0]["output_tokens"] == 30


def test_table_and_csv_output() -> None:
    rows = [{"model": "a", "requests": 3}, {"model": "bb", "requests": None}]
    assert to_csv(rows) == "model,requests\na,3\nbb,\n"
    assert to_table(rows).splitlines() == ["model  requests", "a      3", "bb"]
    assert to_table([]) == "(none)"


def test_cli_creates_a_key_whose_secret_authenticates(tmp_path: Path) -> None:
    env = {**os.environ, "TOKENYARD_STATE_DIR": str(tmp_path)}
    env.pop("TOKENYARD_DATABASE_URL", None)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tokenyard.cli", "admin", *args],
                              env=env, capture_output=True, text=True, timeout=60)

    org = json.loads(cli("orgs", "create", "acme", "--rpm", "5", "--format", "json").stdout)
    made = cli("--format", "json", "keys", "create", "--org", org["id"], "--models", "m*")
    secret = json.loads(made.stdout)["secret"]
    key_id = json.loads(made.stdout)["id"]
    assert cli("priority", "set", "--org", org["id"], "low").returncode == 0
    assert cli("priority", "set", "--key", key_id, "high").returncode == 0
    capture = cli("orgs", "capture", org["id"], "--on", "--retention-days", "3",
                  "--format", "json")
    assert json.loads(capture.stdout) == {"org_id": org["id"], "capture": True,
                                          "retention_days": 3}, capture.stderr
    shown = json.loads(cli("orgs", "capture", org["id"], "--format", "json").stdout)
    assert shown["capture"] is True and shown["retention_days"] == 3
    assert "--cache-write" not in cli("prices", "set", "--help").stdout
    listed = cli("keys", "list", "--format", "csv").stdout
    assert secret not in listed and secret[:10] in listed
    bad = cli("keys", "revoke", "key_nope")
    assert bad.returncode == 2 and "no active key" in bad.stderr

    async def check(admin: Admin, store: Store) -> None:
        key = await store.find_key(secret)
        assert key is not None and key.org_limits.rpm == 5 and key.scopes.models == ("m*",)
        assert key.priority == -1 and (await store.get_org(org["id"])).priority == 1  # type: ignore[union-attr]

    run(tmp_path, check, "tokenyard.db")  # the file the CLI used


def test_credit_amount_must_be_money(tmp_path: Path) -> None:
    async def scenario(admin: Admin, store: Store) -> None:
        org = await admin.create_org({"name": "x"})
        with pytest.raises(AdminError):
            await admin.add_credit(org["id"], {"amount": "abc"})
        with pytest.raises(AdminError):
            await admin.add_credit(org["id"], {})

    run(tmp_path, scenario)


def test_cli_spend_cap_for_a_project_not_the_org_s_is_an_error_not_a_traceback(
    tmp_path: Path,
) -> None:
    """`spend-cap set --project` once printed a foreign-key traceback for an unknown
    project; a project of another org must not be capped either."""
    env = {**os.environ, "TOKENYARD_STATE_DIR": str(tmp_path)}
    env.pop("TOKENYARD_DATABASE_URL", None)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tokenyard.cli", "admin", *args],
                              env=env, capture_output=True, text=True, timeout=60)

    org = json.loads(cli("orgs", "create", "a", "--format", "json").stdout)
    other = json.loads(cli("orgs", "create", "b", "--format", "json").stdout)
    theirs = json.loads(cli("projects", "create", other["id"], "p", "--format",
                            "json").stdout)
    for project in ("proj_nope", theirs["id"]):
        done = cli("spend-cap", "set", org["id"], "5", "--project", project)
        assert done.returncode == 2, done.stderr
        assert f"no project {project} in org {org['id']}" in done.stderr
        assert "Traceback" not in done.stderr
    mine = json.loads(cli("projects", "create", org["id"], "q", "--format", "json").stdout)
    assert cli("spend-cap", "set", org["id"], "5", "--project", mine["id"]).returncode == 0
