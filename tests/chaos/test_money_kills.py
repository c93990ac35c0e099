"""Money held in Redis when a gateway holding it dies, and when Redis loses its keys.

Two gateways on one PostgreSQL and a private `redis-server` (no persistence; never the
machine's shared one), in front of a slow mock replica (5 s a long request), a key whose
monthly budget covers three requests' maximum cost:

- a restart of Redis (SIGKILL, started again empty) while one gateway holds the budget:
  within a heartbeat (1 s) it holds its requests again under a new owner id, so the other
  gateway, seeding the account from the database, still refuses; once they finish, the
  spend is within the budget and Redis's equals the ledger's.
- then `kill -9` of the gateway holding the whole budget (three requests streaming): the
  other refuses, naming the budget, until the dead one's holds lapse
  (`TOKENYARD_MONEY_HOLD_TTL_S`, 3 s here, after its last heartbeat), then serves; what
  was spent stays within the budget, and Redis's running spend equals the ledger's.

Each scenario uses a key of its own (both share the two gateways, in that order).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.chaos.conftest import Recorder, Scale
from tests.chaos.invariants import check_quiescent
from tests.chaos.test_kills import private_redis
from tests.e2e.conftest import Server
from tests.integration.test_money_two_gateways import (
    MAX_TOKENS,
    Case,
    Pair,
    at_once,
    ledger_spend,
    new_case,
    one_request,
    redis_account,
    two_gateways,
)
from tests.integration.test_store_postgres import (  # noqa: F401
    postgres_admin_dsn,
    postgres_database,
)
from tokenyard.bench.mock_core import MockConfig

pytestmark = pytest.mark.slow

LONG = 50  # tokens of a long request: 5 s at 100 ms a token
HOLD_TTL_S = 3.0


@pytest.fixture(scope="module")
def fleet(postgres_database: str) -> Iterator[tuple[Pair, Any]]:  # noqa: F811
    """Two gateways on the module's database and a private Redis (and its restart),
    shared by both scenarios: the restart first, then the kill (of the first gateway)."""
    with private_redis() as (port, restart), two_gateways(
            postgres_database, f"redis://127.0.0.1:{port}/0",
            replica=MockConfig(output_len=64, ttft_ms=0.0, itl_ms=100.0),
            env={"TOKENYARD_MONEY_HOLD_TTL_S": str(HOLD_TTL_S)}) as pair:
        yield pair, restart


def _budget_case(pair: Pair) -> Case:
    per_long = 2 * max(pair.chat_prompt, pair.messages_prompt) + LONG
    return new_case(pair.gateways[1], "key_month", 3 * per_long + per_long // 2)


async def _hold_all(pair: Pair, case: Case) -> list[asyncio.Task[Any]]:
    """Three long streamed requests on the first gateway, once Redis holds them."""
    tasks = [asyncio.create_task(one_request(pair.gateways[0], case.secret, 0, LONG))
             for _ in range(3)]
    deadline = time.monotonic() + 15
    while await asyncio.to_thread(redis_held, pair, case) < 3:
        assert time.monotonic() < deadline, "three requests never held"
        await asyncio.sleep(0.05)
    return tasks


def redis_held(pair: Pair, case: Case) -> int:
    """How many long requests' holds the case's account has."""
    assert pair.redis_url is not None
    client = redis.Redis.from_url(pair.redis_url, decode_responses=True)
    try:
        month = time.strftime("%Y-%m", time.gmtime())
        fields = client.hgetall(f"{{tokenyard:money:}}key_month:{case.ids['key']}:{month}")
    finally:
        client.close()
    held = sum(int(v) for k, v in fields.items() if k.startswith("h:"))
    return held // (2 * pair.chat_prompt + LONG)  # a streamed chat request's (n 1)


def _refused_naming(case: Case, answers: list[tuple[str, Any]]) -> int:
    refused = [a for outcome, a in answers if outcome == "refused"]
    for status, code, message in refused:
        assert (status, code) in ((429, "insufficient_quota"), (402, "billing_error"))
        assert case.name() in message, message
    return len(refused)


def _within_budget(pair: Pair, case: Case, served: int,
                   gateways: tuple[Server, ...]) -> dict[str, Any]:
    """Once `served` requests' ledger rows landed: what was spent is within the budget,
    Redis's running spend equals the ledger's, no hold is left and `gateways` are
    quiescent. The figures to record."""
    spent = ledger_spend(pair.gateways[1], case, served)
    assert spent <= case.amount
    redis_spent, left_held = redis_account(pair, case)
    assert (redis_spent, left_held) == (spent, 0)
    quiet = [check_quiescent(gateway) for gateway in gateways][-1]
    return {"budget_micros": case.amount, "spent_micros": spent,
            "redis_spent_micros": redis_spent, "holds_left": left_held, **quiet}


def test_restart_of_redis_holding_money(fleet: tuple[Pair, Any], scale: Scale,
                                        record: Recorder) -> None:
    pair, restart = fleet
    case = _budget_case(pair)
    n = 50 if scale == "full" else 20

    async def scenario() -> dict[str, Any]:
        held = await _hold_all(pair, case)
        restart(True)
        restart(False)
        await asyncio.sleep(1.5)  # a heartbeat: the holding gateway holds them again
        during = await at_once(pair, case.secret, n, gateways=(1,))
        answers = await asyncio.gather(*held)
        after = await at_once(pair, case.secret, n, gateways=(1,))
        return {"refused_during": _refused_naming(case, during), "holding_served":
                sum(outcome == "ok" for outcome, _ in answers),
                "served_after": n - _refused_naming(case, after)}

    held = asyncio.run(scenario())
    assert held["refused_during"] == n and held["holding_served"] == 3, held
    figures = _within_budget(pair, case, 3 + held["served_after"], pair.gateways)
    record("restart of Redis holding money",
           command="two tokenyard serve on PostgreSQL and a private redis-server; the "
                   "redis-server killed (SIGKILL) and started empty while one gateway "
                   "holds a key's whole budget",
           sent={"holding_requests": 3, "requests_during": n, "requests_after": n},
           held={**held, **figures})


def test_kill_9_of_a_gateway_holding_money(fleet: tuple[Pair, Any], scale: Scale,
                                            record: Recorder) -> None:
    pair, _ = fleet
    case = _budget_case(pair)
    n = 50 if scale == "full" else 20

    async def scenario() -> dict[str, Any]:
        held = await _hold_all(pair, case)
        before = await at_once(pair, case.secret, n, gateways=(1,))
        assert _refused_naming(case, before) == n
        killed_at = time.monotonic()
        os.kill(pair.first.pid, signal.SIGKILL)
        await asyncio.gather(*held, return_exceptions=True)
        while (await one_request(pair.gateways[1], case.secret, 0, MAX_TOKENS))[0] != "ok":
            assert time.monotonic() - killed_at < HOLD_TTL_S + 10, "the holds never lapsed"
            await asyncio.sleep(0.1)
        recovery = time.monotonic() - killed_at
        after = await at_once(pair, case.secret, n, gateways=(1,))
        return {"refused_while_held": n, "recovery_s": round(recovery, 2),
                "served_after": 1 + n - _refused_naming(case, after)}

    held = asyncio.run(scenario())
    assert held["recovery_s"] <= HOLD_TTL_S + 2.5, held
    figures = _within_budget(pair, case, held["served_after"], pair.gateways[1:])
    record("kill -9 of a gateway holding money",
           command="two tokenyard serve on PostgreSQL and a private redis-server "
                   f"(TOKENYARD_MONEY_HOLD_TTL_S={HOLD_TTL_S:g}); kill -9 the one holding "
                   "a key's whole budget",
           sent={"holding_requests": 3, "requests_while_held": n, "requests_after": n},
           held={**held, **figures})
