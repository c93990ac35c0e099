"""Money held in Redis (`RedisMoney`, issue 40) against a real Redis, by several owners
(gateway processes) at once: all-or-nothing holds over every account of a request, the
refusal naming the account, settlement charging the real cost, a dead owner's holds
lapsing after the hold ttl, credit added in the database raising a balance, and an owner
that finds its holds gone (Redis flushed) holding its requests in flight again. On
TOKENYARD_REDIS_URL (default redis://127.0.0.1:6379/0); skipped when it is unreachable,
failed instead when CI is set. The HTTP path (two `tokenyard serve` processes) is
tests/integration/test_money_two_gateways.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence

import pytest
import redis

from tests.conftest import REDIS_URL
from tokenyard.errors import APIError
from tokenyard.gateway.money_holds import Account
from tokenyard.gateway.redis_money import RedisHold, RedisMoney
from tokenyard.store.records import CreditState

MONTH = "2026-11"


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A fresh key prefix for this test; its keys are deleted afterwards."""
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=1, socket_timeout=5)
    name = f"test-money-{uuid.uuid4().hex[:12]}:"
    yield name
    keys = list(client.scan_iter(match="{" + name + "}*"))
    if keys:
        client.delete(*keys)
    client.close()


class Figures:
    """What the database says each account starts from (by account name), and how many
    times it was asked."""

    def __init__(self, figures: dict[str, int | CreditState]) -> None:
        self.figures = figures
        self.reads = 0

    async def __call__(self, accounts: Sequence[Account]) -> list[int | CreditState]:
        self.reads += 1
        await asyncio.sleep(0.01)  # a database read: requests at once overlap it
        return [self.figures[a.name] for a in accounts]


def run(prefix: str, body: Callable[[list[RedisMoney]], Awaitable[None]], owners: int = 2,
        hold_ttl: float = 30.0) -> None:
    """`body` with `owners` RedisMoney on `prefix` (each a gateway process), closed after."""
    async def main() -> None:
        moneys = [RedisMoney(REDIS_URL, prefix=prefix, hold_ttl=hold_ttl)
                  for _ in range(owners)]
        try:
            await body(moneys)
        finally:
            for money in moneys:
                await money.close()

    asyncio.run(main())


def cap(kind: str, subject: str, micros: int, hold: int) -> Account:
    month = None if kind.endswith("_total") else MONTH
    return Account(kind, subject, "org_a", month, micros, hold)  # type: ignore[arg-type]


def balance(hold: int, credited: int = 0, seq: int = 0) -> Account:
    return Account("balance", "org_a", "org_a", None, None, hold,
                   CreditState(0, credited, seq))


async def attempt(money: RedisMoney, accounts: list[Account],
                  seed: Figures) -> RedisHold | APIError:
    try:
        return await money.reserve(accounts, seed)
    except APIError as err:
        return err


async def settle_all(moneys: list[RedisMoney], holds: Sequence[tuple[int, RedisHold]],
                     cost: int) -> None:
    for i, hold in holds:
        moneys[i].settle(hold, cost, MONTH)
    for money in moneys:
        while money._settling:
            await asyncio.sleep(0.01)


def test_two_owners_at_once_hold_no_more_than_a_budget_covers(prefix: str) -> None:
    """40 reservations of 30 micros from two owners against a 100-micro key budget
    that 10 are already spent of: exactly 3 are held, each refusal names the budget, one
    database read seeded it; settled at 25 each, the budget has 15 left, for none."""
    seed = Figures({f"key_month:key_a:{MONTH}": 10})
    account = cap("key_month", "key_a", 100, 30)

    async def body(moneys: list[RedisMoney]) -> None:
        results = await asyncio.gather(*(attempt(moneys[i % 2], [account], seed)
                                         for i in range(40)))
        holds = [(i % 2, r) for i, r in enumerate(results) if isinstance(r, RedisHold)]
        refused = [r for r in results if isinstance(r, APIError)]
        assert len(holds) == 3 and len(refused) == 37
        assert {r.status for r in refused} == {429}
        assert all("monthly budget of API key key_a" in r.message for r in refused)
        assert seed.reads <= 2  # one per owner at most (each coalesces its own)
        await settle_all(moneys, holds, 25)
        err = await attempt(moneys[0], [account], seed)
        assert isinstance(err, APIError)
        assert "0.000015 left" in err.message and "held" not in err.message
        ok = await attempt(moneys[1], [cap("key_month", "key_a", 100, 15)], seed)
        assert isinstance(ok, RedisHold)

    run(prefix, body)


def test_a_hold_is_all_or_nothing_across_accounts(prefix: str) -> None:
    """A request over the user's budget holds nothing on its org's balance or cap."""
    seed = Figures({"balance:org_a:all": CreditState(1_000, 0, 0),
                    f"org_cap:org_a:{MONTH}": 0, "user_total:user_a:all": 90})

    async def body(moneys: list[RedisMoney]) -> None:
        accounts = [balance(50), cap("org_cap", "org_a", 500, 50),
                    cap("user_total", "user_a", 100, 50)]
        err = await attempt(moneys[0], accounts, seed)
        assert isinstance(err, APIError)
        assert "total budget of user user_a" in err.message and "0.000010 left" in err.message
        # Nothing was held on the balance: it still covers 1000 (20 holds of 50).
        holds = [await moneys[1].reserve([balance(50)], seed) for _ in range(20)]
        assert isinstance(await attempt(moneys[0], [balance(1)], seed), APIError)
        await settle_all(moneys, [(1, h) for h in holds], 0)
        assert isinstance(await attempt(moneys[0], [balance(1_000)], seed), RedisHold)

    run(prefix, body)


def test_credit_added_in_the_database_raises_the_balance_in_order(prefix: str) -> None:
    """A balance seeded at 100 (credit 100, seq 1) that spent 100 is used up; a request
    that read credit 300 (seq 2) sees 200 more; one that read the older credit does not
    lower it again."""
    seed = Figures({"balance:org_a:all": CreditState(100, 100, 1)})

    async def body(moneys: list[RedisMoney]) -> None:
        hold = await moneys[0].reserve([balance(100, 100, 1)], seed)
        await settle_all(moneys, [(0, hold)], 100)
        err = await attempt(moneys[1], [balance(1, 100, 1)], seed)
        assert isinstance(err, APIError) and "balance is used up" in err.message
        assert isinstance(await attempt(moneys[1], [balance(150, 300, 2)], seed), RedisHold)
        assert isinstance(await attempt(moneys[0], [balance(50, 100, 1)], seed), RedisHold)
        err = await attempt(moneys[0], [balance(1, 100, 1)], seed)
        assert isinstance(err, APIError) and "held by requests in flight" in err.message

    run(prefix, body)


def test_a_dead_owners_holds_lapse_after_the_hold_ttl(prefix: str) -> None:
    """An owner that stops beating (a gateway killed holding money) keeps its holds for
    the hold ttl, then another owner may use the budget."""
    seed = Figures({f"org_cap:org_a:{MONTH}": 0})
    account = cap("org_cap", "org_a", 100, 100)

    async def body(moneys: list[RedisMoney]) -> None:
        dead, live = moneys
        await dead.reserve([account], seed)
        assert dead._heartbeat is not None
        dead._heartbeat.cancel()  # killed: no more heartbeats, no settle
        err = await attempt(live, [account], seed)
        assert isinstance(err, APIError) and "spend cap" in err.message
        await asyncio.sleep(1.6)
        assert isinstance(await attempt(live, [account], seed), RedisHold)
        dead.owner = ""  # its close must not touch the live owner's state

    run(prefix, body, hold_ttl=1.0)


def test_an_owner_whose_holds_redis_lost_holds_them_again(prefix: str) -> None:
    """Redis loses every key (FLUSHALL, a restart without persistence): the next reserve
    finds its owner gone, takes a new one, holds its request in flight again and seeds
    the account anew from the database, so the budget is not spent twice."""
    seed = Figures({f"project_cap:proj_a:{MONTH}": 0})
    account = cap("project_cap", "proj_a", 100, 60)
    client = redis.Redis.from_url(REDIS_URL)

    async def body(moneys: list[RedisMoney]) -> None:
        money = moneys[0]
        running = await money.reserve([account], seed)
        lost = money.owner
        client.delete(*client.scan_iter(match="{" + prefix + "}*"))
        err = await attempt(money, [account], seed)
        assert money.owner != lost and running.owner == money.owner
        assert isinstance(err, APIError) and "Project proj_a" in err.message, err
        await settle_all(moneys, [(0, running)], 60)
        err = await attempt(money, [account], seed)  # 60 spent of 100
        assert isinstance(err, APIError) and "0.000040 left)" in err.message

    try:
        run(prefix, body, owners=1)
    finally:
        client.close()
