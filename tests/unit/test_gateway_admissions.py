"""`Gateway.admissions_open`: the rate-limit admissions not settled yet, which the
dashboard shows and the reliability suite expects back at 0 once traffic stops."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tokenyard.gateway.billing import Billing
from tokenyard.gateway.gate import FAILED, Gateway, RateLimitExceeded, Ticket
from tokenyard.gateway.limits import InProcessLimiter
from tokenyard.store import Database, LedgerWriter, Store
from tokenyard.telemetry.timeline import Timeline


def test_an_admission_is_open_until_its_ticket_is_settled(tmp_path: Path) -> None:
    async def scenario() -> list[int]:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'g.db'}")
        store = Store(db)
        org = await store.create_org("acme")
        secret, _ = await store.create_api_key(org.id, name="k", max_concurrency=1)
        ledger = LedgerWriter(db, tmp_path / "journal")
        await ledger.start()
        gateway = Gateway(store, InProcessLimiter(), Billing(store, ledger))
        seen = [gateway.admissions_open]
        try:
            key = await gateway.authenticate({"authorization": f"Bearer {secret}"}, Timeline())

            async def admit(rid: str) -> Ticket:
                return await gateway.admit(key, model="m", endpoint="/v1/chat/completions",
                                           request_id=rid, prompt_tokens=5, max_tokens=5,
                                           timeline=Timeline())

            ticket = await admit("r1")
            seen.append(gateway.admissions_open)
            with pytest.raises(RateLimitExceeded):  # its one slot is held: refused, not counted
                await admit("r2")
            seen.append(gateway.admissions_open)
            gateway.finish(ticket, None, FAILED)
            for _ in range(3):  # the settlement runs as a task
                await asyncio.sleep(0)
            seen.append(gateway.admissions_open)
            await admit("r3")  # the slot is back
            seen.append(gateway.admissions_open)
        finally:
            await gateway.close()
        return seen

    assert asyncio.run(scenario()) == [0, 1, 1, 0, 1]
