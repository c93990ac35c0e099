"""Issue 29: the user level of org → project → user, and per-key and per-user budgets,
through HTTP on a running `tokenyard serve` (the official openai and anthropic SDKs for
the model routes, the admin API for the rest).

The fleet is one upstream deployment on the project's mock OpenAI server (no model to
load), priced at 1 per million tokens in and out: a request costs one micro per token.

- an admin creates a user in a project and two keys of it (a key of another org's user is
  refused); the user is in the request records (the tenant's and the admin's view) and
  in the usage report grouped by user;
- a key's total budget and a user's monthly budget each refuse, once spent, with 429
  insufficient_quota naming which budget, in OpenAI's and in Anthropic's error shape;
  the user's budget counts the spend of all its keys; the dashboard shows both;
- requests at once never spend past a budget: each holds its maximum cost at admission.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import Server, running_server
from tests.integration.test_upstream_tenancy import _serving
from tokenyard.bench.mock_core import MockConfig
from tokenyard.bench.mock_replica import MockReplica

MODEL = "budget-upstream-2026-12-01"
MICRO = Decimal("0.000001")


@dataclass
class Fleet:
    server: Server
    mock: MockReplica


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    # Slow enough (100 ms to the first token) that requests sent at once overlap.
    # Replies as long as max_tokens asks, up to 60 tokens (the other tests ask for 3).
    mock = MockReplica(MockConfig(output_len=60, ttft_ms=100.0, itl_ms=0.0))
    with _serving({MODEL: mock.make_app()}) as urls, tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "tokenyard.toml"
        config.write_text(f"""
[balancer]
queue_timeout_s = 0

[[deployments]]
name = "{MODEL}"
kind = "upstream"
urls = ["{urls[MODEL]}/v1"]
model = "mock"
prices = {{ input = "1", cached_input = "1", output = "1" }}
""")
        with running_server("--config", str(config)) as (server, _):
            yield Fleet(server, mock)


def admin(fleet: Fleet, method: str, path: str, body: dict[str, Any] | None = None,
          status: int | None = None) -> Any:
    r = httpx.request(method, fleet.server.base_url + path, json=body, timeout=30,
                      headers=fleet.server.headers)
    if status is not None:
        assert r.status_code == status, r.text
    return r.json()


def new_org(fleet: Fleet, name: str) -> str:
    return str(admin(fleet, "POST", "/admin/v1/orgs", {"name": name}, 201)["id"])


def client(fleet: Fleet, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.server.base_url + "/v1", api_key=secret,
                         max_retries=0)


def chat(fleet: Fleet, secret: str, content: str = "Hello there") -> str:
    """One chat request; its request id."""
    raw = client(fleet, secret).chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": content}])
    raw.parse()
    return str(raw.headers["x-request-id"])


def refusal(fleet: Fleet, secret: str) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as caught:
        chat(fleet, secret)
    err = caught.value
    assert err.status_code == 429 and err.code == "insufficient_quota"
    assert err.response.headers.get("x-should-retry") == "false"
    return err


def spend_until_refused(fleet: Fleet, secret: str, limit: int = 20) -> openai.RateLimitError:
    """Chat with `secret` until a request is refused (at most `limit` served first)."""
    for _ in range(limit):
        try:
            chat(fleet, secret)
        except openai.RateLimitError as err:
            assert err.code == "insufficient_quota", err
            return err
    raise AssertionError(f"{limit} requests served and none refused")


def ledger_cost(fleet: Fleet, group_by: str, org_id: str, requests: int) -> dict[str, Any]:
    """The usage report's rows by `group_by` once the org's `requests` rows landed."""
    deadline = time.monotonic() + 10
    while True:
        rows = admin(fleet, "GET", f"/admin/v1/usage?group_by={group_by}&org_id={org_id}",
                     status=200)["data"]
        if sum(row["requests"] for row in rows) >= requests:
            return {row["group"]: row for row in rows}
        assert time.monotonic() < deadline, f"no ledger rows for {org_id}: {rows}"
        time.sleep(0.05)


def test_a_users_keys_records_and_usage_grouped_by_user(fleet: Fleet) -> None:
    org = new_org(fleet, "users")
    project = admin(fleet, "POST", f"/admin/v1/orgs/{org}/projects", {"name": "web"}, 201)
    ada = admin(fleet, "POST", "/admin/v1/users", {
        "org_id": org, "email": "ada@acme.test", "name": "Ada",
        "project_id": project["id"]}, 201)
    assert ada["id"].startswith("user_") and ada["project_id"] == project["id"]
    # One email names one user of an org; a user needs an address.
    err = admin(fleet, "POST", "/admin/v1/users", {"org_id": org, "email": "ada@acme.test"},
                400)
    assert err["error"]["param"] == "email"
    admin(fleet, "POST", "/admin/v1/users", {"org_id": org, "email": "nobody"}, 400)
    listed = admin(fleet, "GET", f"/admin/v1/users?org_id={org}", status=200)["data"]
    assert [user["email"] for user in listed] == ["ada@acme.test"]

    # Keys of the user: they default to its project. A key of it in another org is refused.
    keys = [admin(fleet, "POST", "/admin/v1/keys",
                  {"org_id": org, "user_id": ada["id"], "name": f"k{i}"}, 201)
            for i in range(2)]
    assert {(k["user_id"], k["project_id"]) for k in keys} == {(ada["id"], project["id"])}
    other = new_org(fleet, "other")
    err = admin(fleet, "POST", "/admin/v1/keys", {"org_id": other, "user_id": ada["id"]}, 400)
    assert err["error"]["param"] == "user_id"
    plain = admin(fleet, "POST", "/admin/v1/keys", {"org_id": org, "name": "plain"}, 201)

    ids = [chat(fleet, key["secret"]) for key in (*keys, keys[0], plain)]
    # The request record names the user, to the tenant and to the admin.
    for reader in (keys[1]["secret"], fleet.server.api_key):
        r = httpx.get(f"{fleet.server.base_url}/v1/requests/{ids[0]}", timeout=30,
                      headers={"Authorization": f"Bearer {reader}"})
        assert r.status_code == 200, r.text
        assert r.json()["user_id"] == ada["id"]
    r = httpx.get(f"{fleet.server.base_url}/v1/requests/{ids[3]}", timeout=30,
                  headers={"Authorization": f"Bearer {plain['secret']}"})
    assert r.json()["user_id"] is None

    by_user = ledger_cost(fleet, "user", org, 4)
    assert by_user[ada["id"]]["requests"] == 3 and by_user[None]["requests"] == 1
    by_key = ledger_cost(fleet, "key", org, 4)
    assert Decimal(by_user[ada["id"]]["cost"]) == sum(
        Decimal(by_key[k["id"]]["cost"]) for k in keys)


def test_a_key_budget_and_a_user_budget_refuse_naming_themselves(fleet: Fleet) -> None:
    org = new_org(fleet, "budgets")
    # A key's total budget: 80 micros, a few requests of ~25 tokens each.
    key = admin(fleet, "POST", "/admin/v1/keys",
                {"org_id": org, "name": "capped", "total_budget": "0.000080"}, 201)
    assert key["total_budget"] == "0.000080" and key["monthly_budget"] is None
    err = spend_until_refused(fleet, key["secret"])
    assert f"total budget of API key {key['id']}" in err.message, err.message
    spent = ledger_cost(fleet, "key", org, 1)[key["id"]]
    assert 0 < Decimal(spent["cost"]) <= Decimal("0.000080")
    # Anthropic's route refuses it too, in Anthropic's error shape: a 402 billing_error
    # (not a 429 rate_limit_error, which its SDK would retry), whose request-id header
    # the SDK reads.
    messages = anthropic.Anthropic(base_url=fleet.server.base_url, api_key=key["secret"],
                                   max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as caught:
        messages.messages.create(model=MODEL, max_tokens=200,
                                 messages=[{"role": "user", "content": "Hello there"}])
    body = caught.value.body
    assert caught.value.status_code == 402 and caught.value.request_id, caught.value
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "billing_error"
    assert f"total budget of API key {key['id']}" in body["error"]["message"]
    # A monthly budget below what the key spent: used up (seen within the key cache's
    # second). Raised, the key spends again.
    for budget, served in (({"monthly_budget": "0.000005", "total_budget": "1"}, False),
                           ({"total_budget": "1.00"}, True)):
        admin(fleet, "POST", f"/admin/v1/keys/{key['id']}/budget", budget, 200)
        time.sleep(1.2)
        if served:
            chat(fleet, key["secret"])
        else:
            err = refusal(fleet, key["secret"])
            assert f"monthly budget of API key {key['id']}" in err.message
            assert "is used up" in err.message, err.message

    # A user's monthly budget counts what all its keys spend.
    user = admin(fleet, "POST", "/admin/v1/users", {"org_id": org, "email": "b@acme.test"},
                 201)
    admin(fleet, "POST", f"/admin/v1/users/{user['id']}/budget",
          {"monthly_budget": "0.000080"}, 200)
    first, second = (admin(fleet, "POST", "/admin/v1/keys",
                           {"org_id": org, "user_id": user["id"]}, 201) for _ in range(2))
    spend_until_refused(fleet, first["secret"])
    err = refusal(fleet, second["secret"])
    assert f"monthly budget of user {user['id']}" in err.message, err.message

    listed = {row["id"]: row for row in admin(fleet, "GET", f"/admin/v1/budgets?org_id={org}",
                                              status=200)["data"]}
    assert listed[user["id"]]["monthly_budget"] == "0.000080"
    assert 0 < Decimal(listed[user["id"]]["month_spent"]) <= Decimal("0.000080")
    board = admin(fleet, "GET", "/admin/v1/dashboard", status=200)
    shown = {(row["subject"], row["id"]): row for row in board["budgets"]}
    assert shown[("user", user["id"])]["monthly_budget"] == "0.000080"
    assert shown[("key", key["id"])]["total_budget"] == "1.000000"


def test_requests_at_once_never_spend_past_a_budget(fleet: Fleet) -> None:
    """12 requests at once of ~62 micros each would spend 744 of a 300 budget if the
    budget were only checked against what was spent (each sees nothing spent yet)."""
    org = new_org(fleet, "at-once")
    budget = Decimal("0.000300")
    key = admin(fleet, "POST", "/admin/v1/keys",
                {"org_id": org, "name": "burst", "monthly_budget": str(budget)}, 201)
    chat(fleet, key["secret"])  # the gateway reads the key's spend once, then holds

    async def burst() -> list[BaseException | None]:
        aclient = openai.AsyncOpenAI(base_url=fleet.server.base_url + "/v1",
                                     api_key=key["secret"], max_retries=0)

        async def one() -> None:
            reply = await aclient.chat.completions.create(
                model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Hi"}])
            assert reply.usage is not None and reply.usage.completion_tokens == 60

        results = await asyncio.gather(*(one() for _ in range(12)), return_exceptions=True)
        await aclient.close()
        return list(results)

    results = asyncio.run(burst())
    served = sum(result is None for result in results)
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert served + len(refused) == len(results), results
    spent = Decimal(ledger_cost(fleet, "key", org, served + 1)[key["id"]]["cost"])
    assert spent <= budget, f"{spent} spent of a {budget} budget by {served + 1} requests"
    assert served >= 1 and refused, results
    assert any("held by requests in flight" in err.message for err in refused), refused
