"""gateway/money_server.py: the parent's money accounts, reached over the limit server's
Unix socket by each worker's `SocketMoney`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from tokenyard.errors import APIError
from tokenyard.gateway.limit_server import LimitServer, SocketLimiter
from tokenyard.gateway.money_holds import Account
from tokenyard.gateway.money_server import MemoryMoney, SocketMoney
from tokenyard.store.records import CreditState


def cap_account(hold: int, month: str = "2026-11") -> Account:
    return Account("org_cap", "org_a", "org_a", month, 1000, hold)


def test_holds_are_all_or_nothing_and_settle_charges_the_month() -> None:
    money = MemoryMoney()
    mine: set[str] = set()
    accounts = [cap_account(400), Account("key_total", "k1", "org_a", None, 500, 400)]
    assert money.reserve(accounts, mine) == {"seed": [0, 1]}
    money.seed(accounts, [100, 0])
    first = money.reserve(accounts, mine)["hold"]
    # 900 left on the cap, 400 held: a second 400 fits the cap, not the key (500 - 400).
    assert money.reserve(accounts, mine) == {"refused": [1, 500, 400]}
    assert money.held() == 800  # nothing of the refused one
    money.settle(first, 350, "2026-11", mine)
    money.settle(first, 350, "2026-11", mine)  # idempotent
    assert money.held() == 0 and not mine
    # Spent 100 + 350 on the cap, 350 on the key: 150 left there.
    assert money.reserve([Account("key_total", "k1", "org_a", None, 500, 151)], mine) == {
        "refused": [0, 150, 0]}


def test_a_later_credit_raises_the_balance_and_an_idle_account_is_seeded_again() -> None:
    now = [0.0]
    money = MemoryMoney(idle_ttl=10, clock=lambda: now[0])
    mine: set[str] = set()
    old = Account("balance", "org_a", "org_a", None, None, 300, CreditState(200, 1000, 1))
    money.seed([old], [[200, 1000, 1]])
    assert "refused" in money.reserve([old], mine)
    credited = Account("balance", "org_a", "org_a", None, None, 300, CreditState(700, 1500, 2))
    assert "hold" in money.reserve([credited], mine)  # 200 + 500 credited since
    money.drop(mine)  # its worker went away
    assert money.held() == 0
    now[0] = 11.0
    assert money.reserve([credited], mine) == {"seed": [0]}


def test_workers_share_the_parents_accounts_over_the_socket(tmp_path: Path) -> None:
    async def main() -> None:
        money = MemoryMoney()
        server = LimitServer(tmp_path / "limits.sock", money=money)
        await server.start()
        seeds: list[int] = []

        async def seed(accounts: Sequence[Account]) -> list[int | CreditState]:
            seeds.append(len(accounts))
            return [0 for _ in accounts]

        a, b = SocketLimiter(server.path), SocketLimiter(server.path)
        try:
            worker_a, worker_b = SocketMoney(a), SocketMoney(b)
            held = await worker_a.reserve([cap_account(600)], seed)
            with pytest.raises(APIError) as refused:
                await worker_b.reserve([cap_account(600)], seed)
            assert refused.value.status == 429 and "spend cap" in refused.value.message
            worker_a.settle(held, 500, "2026-11")
            await worker_a.close()
            assert money.held() == 0
            again = await worker_b.reserve([cap_account(500)], seed)  # 500 left
            assert seeds == [1]  # seeded once, by the first
            await b.close()  # worker b dies holding `again`: the server releases it
            for _ in range(100):
                if money.held() == 0:
                    break
                await asyncio.sleep(0.01)
            assert money.held() == 0 and again.id
        finally:
            await a.close()
            await b.close()
            await server.close()

    asyncio.run(main())
