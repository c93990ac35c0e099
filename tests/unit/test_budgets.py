"""`gateway/budgets.py` on its own: the holds, the local spend between reads, and a new
month (the HTTP behaviour is in tests/integration/test_users_budgets.py)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any, cast

import pytest

from tokenyard.errors import APIError
from tokenyard.gateway.budgets import Budgets
from tokenyard.store.records import Budget, KeyContext, Limits, Scopes


class FakeStore:
    """What `Budgets` reads: a wall clock and each subject's (month, total) spend."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 31, 23, 59, tzinfo=UTC)
        self.spend: dict[tuple[str, str], tuple[int, int]] = {}
        self.reads = 0

    def clock(self) -> datetime:
        return self.now

    async def spend_of(self, subject: str, subject_id: str) -> tuple[int, int]:
        self.reads += 1
        return self.spend.get((subject, subject_id), (0, 0))


class FakeLedger:
    async def flush(self) -> None:
        return None


def key(key_budget: Budget = Budget(), user_budget: Budget = Budget(),  # noqa: B008
        user_id: str | None = "user_a") -> KeyContext:
    return KeyContext("key_a", "k", "sk-ty-aaaa", "org_a", None, user_id, Scopes(),
                      Limits(), Limits(), None, None, None, key_budget=key_budget,
                      user_budget=user_budget)


def budgets(store: FakeStore, clock: list[float]) -> Budgets:
    return Budgets(cast(Any, store), cast(Any, FakeLedger()), refresh_s=1.0,
                   clock=lambda: clock[0])


def test_holds_refuse_what_the_budget_left_cannot_cover_and_release_gives_back() -> None:
    store, clock = FakeStore(), [0.0]
    store.spend[("key", "key_a")] = (40, 40)
    gate = budgets(store, clock)
    capped = key(Budget(monthly_micros=100))

    async def scenario() -> None:
        first = await gate.reserve(capped, 50)  # 60 left: held
        assert first is not None and store.reads == 1
        with pytest.raises(APIError) as refused:
            await gate.reserve(capped, 20)  # 60 left, 50 of it held
        assert refused.value.status == 429 and refused.value.code == "insufficient_quota"
        assert "monthly budget of API key key_a" in refused.value.message
        assert "held by requests in flight" in refused.value.message
        gate.release(first)
        gate.release(first)  # idempotent
        second = await gate.reserve(capped, 20)
        gate.settled(capped, 60)  # settled here, before the next read: counted at once
        gate.release(second)
        with pytest.raises(APIError, match=r"is used up: 0\.000100 spent this month"):
            await gate.reserve(capped, 0)
        assert gate.to_json()[0]["month_spent"] == "0.000100"
        # No budget on the key or its user: nothing held, nothing read.
        assert await gate.reserve(key(), 10**9) is None

    asyncio.run(scenario())


def test_a_new_month_waits_for_its_read_and_a_later_read_replaces_local_spend() -> None:
    store, clock = FakeStore(), [0.0]
    store.spend[("user", "user_a")] = (90, 500)
    gate = budgets(store, clock)
    capped = key(user_budget=Budget(monthly_micros=100, total_micros=1_000))

    async def scenario() -> None:
        with pytest.raises(APIError, match="monthly budget of user user_a"):
            await gate.reserve(capped, 20)
        # The month turns: the next admission waits for a read of the new month.
        store.now = datetime(2026, 2, 1, 0, 1, tzinfo=UTC)
        store.spend[("user", "user_a")] = (0, 500)
        hold = await gate.reserve(capped, 20)
        assert hold is not None and store.reads == 2
        gate.settled(capped, 600)
        gate.release(hold)
        # A monthly cap raised past it: the total cap refuses (the budget is the key's
        # context's, as the key cache last read it).
        raised = key(user_budget=Budget(monthly_micros=10_000, total_micros=1_000))
        with pytest.raises(APIError, match="total budget of user user_a"):
            await gate.reserve(raised, 0)
        # A read that began after the local settlement replaces it, counted once.
        store.spend[("user", "user_a")] = (600, 1_100)
        clock[0] = 5.0
        await gate.reserve(key(), 0)  # no budget: starts no read
        with pytest.raises(APIError):
            await gate.reserve(raised, 0)  # starts the background read
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        [view] = gate.to_json()
        assert (view["month_spent"], view["total_spent"]) == ("0.000600", "0.001100")

    asyncio.run(scenario())
