"""Billing's holds (issue 21, finding 9): a request's maximum cost is held against its
org's prepaid balance from admission until it is metered, so concurrent requests see
each other and the org's overdraft is bounded by one request's maximum cost. Over a real
SQLite store and ledger writer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from tokenyard.errors import APIError
from tokenyard.gateway.billing import Billing, Hold, Usage
from tokenyard.gateway.gate import COMPLETED, FAILED, Gateway, Ticket
from tokenyard.gateway.limits import InProcessLimiter
from tokenyard.store import Database, LedgerWriter, Prices, Store
from tokenyard.store.records import KeyContext
from tokenyard.telemetry.timeline import Timeline

T = TypeVar("T")
#: 1 micro an input token, 2 an output token.
PRICES = Prices(input=1_000_000, cached_input=500_000, output=2_000_000)
#: 100 prompt tokens and up to 100 generated: at most 300 micros.
MAX = Usage(prompt_tokens=100, cached_tokens=0, output_tokens=100)


def _run(tmp_path: Path, balance: int | None,
         body: Callable[[Billing, KeyContext], Awaitable[T]]) -> T:
    """`body(billing, key)` for a key of a fresh org prepaid with `balance` micros."""
    async def main() -> T:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'b.db'}")
        store = Store(db)
        ledger = LedgerWriter(db, tmp_path / "journal", flush_interval=0.01)
        await ledger.start()
        try:
            org = await store.create_org("acme", balance_micros=balance)
            secret, _ = await store.create_api_key(org.id, name="k")
            key = await store.find_key(secret)
            assert key is not None
            return await body(Billing(store, ledger), key)
        finally:
            await ledger.close(timeout=1.0)
            await db.close()

    return asyncio.run(main())


async def _reserve_all(billing: Billing, key: KeyContext, n: int
                       ) -> tuple[list[Hold], list[APIError]]:
    """`n` reservations of MAX at once (the org's first sight for all of them)."""
    results = await asyncio.gather(*(billing.reserve(key, PRICES, MAX) for _ in range(n)),
                                   return_exceptions=True)
    errors = [r for r in results if isinstance(r, APIError)]
    assert len(errors) + sum(isinstance(r, Hold) for r in results) == n, results
    return [r for r in results if isinstance(r, Hold)], errors


def _meter(billing: Billing, key: KeyContext, rid: str, usage: Usage) -> int:
    return billing.meter(key, request_id=rid, model="m", endpoint="/v1/chat/completions",
                         status=COMPLETED, usage=usage, prices=PRICES).cost_micros


def test_concurrent_requests_hold_their_maximum_cost_against_the_balance(
    tmp_path: Path,
) -> None:
    async def body(billing: Billing, key: KeyContext) -> tuple[list[int], list[APIError]]:
        holds, refused = await _reserve_all(billing, key, 6)
        return [h.micros for h in holds], refused

    held, refused = _run(tmp_path, 1000, body)
    assert held == [300, 300, 300]  # a fourth would need 1,200 of the 1,000
    assert len(refused) == 3
    for err in refused:
        assert err.status == 429 and err.code == "insufficient_quota"
        assert err.headers["x-should-retry"] == "false"
        assert "held by requests in flight" in err.message and "0.000300" in err.message


def test_the_first_requests_of_an_org_all_wait_for_its_balance(tmp_path: Path) -> None:
    """Not only the first: the others would pass as a postpaid org's before the read."""
    async def body(billing: Billing, key: KeyContext) -> list[BaseException | None]:
        return await asyncio.gather(*(billing.precheck(key) for _ in range(4)),
                                    return_exceptions=True)

    results = _run(tmp_path, 0, body)
    assert all(isinstance(r, APIError) and "used up" in r.message for r in results), results


def test_a_balance_below_one_maximum_cost_is_refused_not_overdrawn(
    tmp_path: Path,
) -> None:
    """Issue 40: a $0.0001 balance ended at -$0.00156 after one request; a request whose
    maximum cost exceeds what is left is refused, with or without holds in flight."""
    async def body(billing: Billing, key: KeyContext) -> list[APIError]:
        holds, refused = await _reserve_all(billing, key, 3)
        assert holds == []
        return refused

    refused = _run(tmp_path, 100, body)
    assert len(refused) == 3
    for err in refused:
        assert err.status == 429 and err.code == "insufficient_quota"
        assert "prepaid balance" in err.message and "0.000300" in err.message


def test_metering_and_release_settle_a_hold_to_the_real_cost(tmp_path: Path) -> None:
    async def body(billing: Billing, key: KeyContext) -> list[object]:
        seen: list[object] = []
        first = await billing.reserve(key, PRICES, MAX)
        second = await billing.reserve(key, PRICES, MAX)  # 600 of 1,000 held
        # 400 left beside the holds: a request of maximum cost 401 is refused.
        big = Usage(prompt_tokens=401, cached_tokens=0, output_tokens=0)
        with pytest.raises(APIError):
            await billing.reserve(key, PRICES, big)
        seen.append(_meter(billing, key, "r1", Usage(50, 0, 10)))  # 70 of its 300
        billing.release(first)
        billing.release(first)  # idempotent
        billing.release(None)
        # 1,000 - 70 spent - 300 held = 630: a request of 630 fits, one of 631 does not.
        with pytest.raises(APIError):
            await billing.reserve(key, PRICES, Usage(631, 0, 0))
        seen.append((await billing.reserve(key, PRICES, Usage(630, 0, 0))).micros)
        billing.release(second)
        return seen

    assert _run(tmp_path, 1000, body) == [70, 630]


def test_a_postpaid_org_is_never_refused_for_its_holds(tmp_path: Path) -> None:
    async def body(billing: Billing, key: KeyContext) -> int:
        holds, refused = await _reserve_all(billing, key, 5)
        assert not refused
        return sum(h.micros for h in holds)

    assert _run(tmp_path, None, body) == 1500


def test_the_gateway_holds_at_admission_and_releases_at_finish(tmp_path: Path) -> None:
    async def body(billing: Billing, key: KeyContext) -> list[object]:
        await billing.store.set_price("m", input=PRICES.input,
                                      cached_input=PRICES.cached_input, output=PRICES.output)
        gateway = Gateway(billing.store, InProcessLimiter(), billing)

        async def admit(rid: str) -> Ticket:
            return await gateway.admit(key, model="m", endpoint="/v1/chat/completions",
                                       request_id=rid, prompt_tokens=100, max_tokens=100,
                                       timeline=Timeline())

        seen: list[object] = []
        ticket = await admit("r1")
        assert ticket.hold is not None
        seen.append(ticket.hold.micros)
        with pytest.raises(APIError) as refused:  # 300 held of 500: another 300 is refused
            await admit("r2")
        seen.append(refused.value.code)
        gateway.finish(ticket, None, FAILED)  # nothing ran: nothing billed, hold back
        seen.append(ticket.hold.released)
        again = await admit("r3")
        gateway.finish(again, Usage(100, 0, 50), COMPLETED)  # 200 billed
        seen.append(again.cost_micros)
        for _ in range(3):  # the limiter's settlements run as tasks
            await asyncio.sleep(0)
        return seen

    assert _run(tmp_path, 500, body) == [300, "insufficient_quota", True, 200]
