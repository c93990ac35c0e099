"""Issue 40 part 2: money exact across gateway processes, through HTTP.

Two `tokenyard serve` processes share one PostgreSQL and one Redis (so they hold money
in Redis: gateway/redis_money.py) in front of one mock engine replica (no model to load)
priced at 1 per million tokens in and out: a request costs one micro a token. For each
kind of account (the org's prepaid balance, its monthly spend cap, a project's, a key's
budget, a user's budget) a fresh org gets an amount that covers about three requests'
maximum cost, and 50 requests go at once, half to each gateway: chat completions
streamed and not, with n of 1 to 3, and Anthropic messages streamed and not. Checked:
- what was spent (the ledger, and the usage the responses reported) is at most the
  amount, exactly, and at least one request ran;
- every other request was refused before it ran, with a 429 insufficient_quota naming
  the account (Anthropic's route: its 402 billing_error, naming it too);
- Redis's running spend equals the ledger's, and no hold is left behind.

Without Redis each gateway holds only its own requests: the same load over the same two
gateways then spent 306 micros of a 273-micro key budget (6 requests ran). On
TOKENYARD_REDIS_URL and a PostgreSQL database of the module's own; skipped when either
is unreachable, failed instead when CI is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis

from tests.e2e.conftest import Server, running_server
from tests.integration.test_store_postgres import (  # noqa: F401
    postgres_admin_dsn,
    postgres_database,
)
from tests.integration.test_upstream_tenancy import _serving
from tokenyard.bench.mock_core import MockConfig
from tokenyard.bench.mock_replica import MockReplica
from tokenyard.store.money import format_money, parse_money

MODEL = "money-mock-2026-12-01"
MAX_TOKENS = 8
REQUESTS = 50
CONTENT = "Say something about money."
#: The money keys' prefix in Redis (RedisMoney's default).
MONEY_KEYS = "{tokenyard:money:}"
#: Each kind of account, and the words its refusals name it by ({...}: the case's ids).
KINDS = {
    "balance": "Your organization's prepaid balance",
    "org_cap": "Your organization",
    "project_cap": "Project {project}",
    "key_month": "monthly budget of API key {key}",
    "user_total": "total budget of user {user}",
}


@dataclass
class Pair:
    """Two gateways on one database (and one Redis, unless None), and the prompt tokens
    of CONTENT on the chat and the Anthropic route."""

    gateways: tuple[Server, Server]
    redis_url: str | None
    first: subprocess.Popen[str]  # the first gateway's process
    chat_prompt: int = 0
    messages_prompt: int = 0


@contextlib.contextmanager
def mock_fleet(replica: MockConfig | None = None) -> Iterator[tuple[str, Path]]:
    """A mock replica (by default 40 ms to the first token, 5 ms a token: requests sent at
    once overlap) and a state directory holding a fleet file that serves MODEL from it,
    priced at one micro a token: (the directory, the fleet file)."""
    mock = MockReplica(replica or MockConfig(output_len=64, ttft_ms=40.0, itl_ms=5.0))
    with _serving({"replica": mock.make_app()}) as urls, \
            tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "fleet.toml"
        config.write_text(f"""
[balancer]
queue_timeout_s = 10

[[deployments]]
name = "{MODEL}"
urls = ["{urls['replica']}"]
prices = {{ input = "1", cached_input = "1", output = "1" }}
""")
        yield tmp, config


def measure_prompts(pair: Pair) -> None:
    """Set `pair`'s prompt tokens of CONTENT on the chat and the Anthropic route."""
    a, b = pair.gateways
    chat = openai.OpenAI(base_url=a.base_url + "/v1", api_key=a.api_key,
                         max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": CONTENT}])
    assert chat.usage is not None
    pair.chat_prompt = chat.usage.prompt_tokens
    message = anthropic.Anthropic(base_url=b.base_url, api_key=b.api_key,
                                  max_retries=0).messages.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": CONTENT}])
    pair.messages_prompt = message.usage.input_tokens


@contextlib.contextmanager
def two_gateways(database_url: str, redis_url: str | None, *,
                 replica: MockConfig | None = None,
                 env: dict[str, str] | None = None) -> Iterator[Pair]:
    """Two gateways over a mock replica (`mock_fleet`); `env`: more of their environment.
    The first may be killed (its exit is not checked)."""
    with mock_fleet(replica) as (tmp, config):
        env = {**(env or {}), "TOKENYARD_DATABASE_URL": database_url}
        if redis_url is not None:
            env["TOKENYARD_REDIS_URL"] = redis_url
        # One state directory: the second start reads the first's development key.
        with running_server("--config", str(config), state_dir=tmp, env=env,
                            check_exit=False) as (a, first), \
                running_server("--config", str(config), state_dir=tmp, env=env) as (b, _):
            pair = Pair((a, b), redis_url, first)
            measure_prompts(pair)
            yield pair


@pytest.fixture(scope="module")
def pair(postgres_database: str, redis_url: str) -> Iterator[Pair]:  # noqa: F811
    with two_gateways(postgres_database, redis_url) as found:
        yield found


def admin(server: Server, method: str, path: str, body: dict[str, Any] | None = None,
          status: int = 200) -> Any:
    r = httpx.request(method, server.base_url + path, json=body, timeout=30,
                      headers=server.headers)
    assert r.status_code == status, r.text
    return r.json()


@dataclass
class Case:
    """A fresh org whose `kind` of account has `amount` micros, and a key to spend it."""

    kind: str
    amount: int
    org: str
    secret: str
    ids: dict[str, str]

    def name(self) -> str:
        """The words a refusal must name the account by."""
        return KINDS[self.kind].format(**self.ids)


def new_case(server: Server, kind: str, amount: int) -> Case:
    money = format_money(amount)
    org = admin(server, "POST", "/admin/v1/orgs",
                {"name": f"money-{kind}", **({"balance": money} if kind == "balance"
                                            else {})}, 201)["id"]
    project = admin(server, "POST", f"/admin/v1/orgs/{org}/projects", {"name": "p"}, 201)
    user = admin(server, "POST", "/admin/v1/users",
                 {"org_id": org, "email": f"{kind}@money.test",
                  "project_id": project["id"],
                  **({"total_budget": money} if kind == "user_total" else {})}, 201)
    key = admin(server, "POST", "/admin/v1/keys",
                {"org_id": org, "user_id": user["id"], "name": kind,
                 **({"monthly_budget": money} if kind == "key_month" else {})}, 201)
    if kind in ("org_cap", "project_cap"):
        admin(server, "POST", f"/admin/v1/orgs/{org}/spend_cap",
              {"cap": money, **({"project_id": project["id"]} if kind == "project_cap"
                                else {})})
    return Case(kind, amount, org, key["secret"],
                {"org": org, "project": project["id"], "key": key["id"], "user": user["id"]})


async def one_request(server: Server, secret: str, i: int,
                      max_tokens: int = MAX_TOKENS) -> tuple[str, Any]:
    """Request `i` of the mix: ("ok", micros it reported using) or ("refused", (status,
    error type or code, message)). Chat completions with n = 1, 2, 3, streamed every other
    time, and Anthropic messages, streamed every other time."""
    messages: Any = [{"role": "user", "content": CONTENT}]
    stream = i % 2 == 0
    try:
        if i % 4 == 3:
            claude = anthropic.AsyncAnthropic(base_url=server.base_url, api_key=secret,
                                              max_retries=0)
            if stream:
                async with claude.messages.stream(model=MODEL, max_tokens=max_tokens,
                                                  messages=messages) as events:
                    final = await events.get_final_message()
            else:
                final = await claude.messages.create(model=MODEL, max_tokens=max_tokens,
                                                     messages=messages)
            return "ok", final.usage.input_tokens + final.usage.output_tokens
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=secret,
                                    max_retries=0)
        n = 1 + i % 3
        if stream:
            chunks = await client.chat.completions.create(
                model=MODEL, max_tokens=max_tokens, n=n, messages=messages, stream=True,
                stream_options={"include_usage": True})
            usage = None
            async for chunk in chunks:
                usage = chunk.usage or usage
        else:
            usage = (await client.chat.completions.create(
                model=MODEL, max_tokens=max_tokens, n=n, messages=messages)).usage
        assert usage is not None
        return "ok", usage.prompt_tokens + usage.completion_tokens
    except openai.APIStatusError as err:
        return "refused", (err.status_code, err.code, err.message)
    except anthropic.APIStatusError as err:
        body = err.body if isinstance(err.body, dict) else {}
        error = body.get("error", {})
        return "refused", (err.status_code, error.get("type"), error.get("message", ""))


async def at_once(pair: Pair, secret: str, requests: int = REQUESTS,
                  gateways: tuple[int, ...] = (0, 1)) -> list[tuple[str, Any]]:
    """`requests` of the mix at once, spread over `gateways` in turn."""
    return list(await asyncio.gather(*(
        one_request(pair.gateways[gateways[i % len(gateways)]], secret, i)
        for i in range(requests))))


def ledger_spend(server: Server, case: Case, requests: int) -> int:
    """The org's ledger cost in micros once its `requests` rows landed."""
    deadline = time.monotonic() + 15
    while True:
        rows = admin(server, "GET", f"/admin/v1/usage?group_by=org&org_id={case.org}")["data"]
        if sum(row["requests"] for row in rows) >= requests:
            return sum(parse_money(row["cost"]) for row in rows)
        assert time.monotonic() < deadline, f"{requests} ledger rows expected: {rows}"
        time.sleep(0.1)


def redis_account(pair: Pair, case: Case) -> tuple[int, int]:
    """The case's account in Redis once every hold on it is settled: (spent, held)."""
    month = datetime.now(UTC).strftime("%Y-%m")
    subject = {"balance": "org", "org_cap": "org", "project_cap": "project",
               "key_month": "key", "user_total": "user"}[case.kind]
    period = {"balance": "all", "user_total": "all"}.get(case.kind, month)
    assert pair.redis_url is not None
    client = redis.Redis.from_url(pair.redis_url, decode_responses=True)
    try:
        key = f"{MONEY_KEYS}{case.kind}:{case.ids[subject]}:{period}"
        deadline = time.monotonic() + 10
        while True:
            fields = client.hgetall(key)
            held = sum(int(v) for name, v in fields.items() if name.startswith("h:"))
            if held == 0 or time.monotonic() > deadline:
                return int(fields["spent"]), held
            time.sleep(0.05)
    finally:
        client.close()


def spend_past_budget_check(pair: Pair, kind: str) -> tuple[Case, int]:
    """Fifty requests at once over `pair`'s gateways against a fresh account of `kind`
    covering three and a half: each refusal names the account, and the ledger spent
    exactly what the answers reported, at most the amount. The case, and what it spent."""
    # The dearest a 1-completion request may cost: a budget holds its prompt at the 1-hour
    # prompt-cache write price (twice the input price), the others at the input price.
    prompt = max(pair.chat_prompt, pair.messages_prompt)
    per_request = (2 if kind.startswith(("key", "user")) else 1) * prompt + MAX_TOKENS
    case = new_case(pair.gateways[0], kind, 3 * per_request + per_request // 2)

    results = asyncio.run(at_once(pair, case.secret))
    ok = [micros for outcome, micros in results if outcome == "ok"]
    refused = [answer for outcome, answer in results if outcome == "refused"]
    assert ok, results
    assert len(ok) + len(refused) == REQUESTS
    for status, code, message in refused:
        assert (status, code) in ((429, "insufficient_quota"), (402, "billing_error")), \
            (status, code, message)
        assert case.name() in message, message

    spent = ledger_spend(pair.gateways[1], case, len(ok))
    assert spent == sum(ok) <= case.amount, (spent, case.amount, len(ok))
    return case, spent


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_gateways_never_spend_past_an_account(pair: Pair, kind: str) -> None:
    case, spent = spend_past_budget_check(pair, kind)
    redis_spent, held = redis_account(pair, case)
    assert held == 0
    assert redis_spent == spent
