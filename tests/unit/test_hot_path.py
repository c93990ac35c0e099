"""The gateway's hot-path bookkeeping (issue 22): what each request costs stays O(1) and
is skipped where it cannot matter.

- the org moderation table is read by one query at a time, in the background once it
  was read, however many requests find it stale; an admin change is seen at once;
- an org's spend view keeps running totals of what settled since its last read;
- a pool of one member behind the process's own table hashes no prompt and records no
  placement (nothing to choose between); with two members it does.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from tests.unit.test_pool import PROMPT, FakeReplica, collect, make_pool
from tokenyard.gateway import moderation
from tokenyard.gateway.billing import _OrgView
from tokenyard.gateway.moderation import Moderator


class _Store:
    db = object()


def test_a_stale_org_table_is_read_once_in_the_background(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    table = {"org_a": ("block", "off")}

    async def org_policies(db: Any) -> dict[str, tuple[str, str]]:
        reads.append(1)
        await asyncio.sleep(0.01)
        return dict(table)

    async def set_org_policy(db: Any, org_id: str, input: str, output: str) -> None:
        table[org_id] = (input, output)

    monkeypatch.setattr(moderation, "org_policies", org_policies)
    monkeypatch.setattr(moderation, "set_org_policy", set_org_policy)

    async def scenario() -> None:
        moderator = Moderator(_Store(), refresh_s=60.0)  # type: ignore[arg-type]
        # Never read: every request waits, on one read.
        first = await asyncio.gather(*(moderator.org_policy("org_a") for _ in range(20)))
        assert first == [("block", "off")] * 20 and len(reads) == 1
        # Stale: requests answer from the last table at once; one read runs behind.
        moderator.refresh_s = 0.0
        table["org_a"] = ("flag", "off")
        stale = await asyncio.gather(*(moderator.org_policy("org_a") for _ in range(20)))
        assert stale == [("block", "off")] * 20 and len(reads) == 2
        await asyncio.sleep(0.05)
        moderator.refresh_s = 60.0
        assert await moderator.org_policy("org_a") == ("flag", "off")
        # An admin change through this process is seen by the next request.
        await moderator.set_org_policy("org_a", "off", "block")
        assert await moderator.org_policy("org_a") == ("off", "block")

    asyncio.run(scenario())


def test_an_org_view_keeps_running_totals() -> None:
    view = _OrgView(month_spend=1_000, project_spend={"p1": 400})
    rng = random.Random(7)
    entries = []
    for seq in range(1, 301):
        project = rng.choice([None, "p1", "p2"])
        cost = rng.randrange(0, 50)
        view.settled(seq, project, cost)
        entries.append((seq, project, cost))
        if seq % 50 == 0:  # a read that began at seq - 20 lands
            view.forget_until(seq - 20)
            entries = [e for e in entries if e[0] > seq - 20]
        for project_id in (None, "p1", "p2"):
            org = 1_000 + sum(c for _, _, c in entries)
            proj = ({"p1": 400}.get(project_id or "", 0)
                    + sum(c for _, p, c in entries if p == project_id))
            assert view.spent(project_id) == (org, proj, len(entries))


def test_an_org_view_forgets_free_requests() -> None:
    # Free requests (a model without prices) settle at 0: the project's figure reaches 0
    # and its key goes while their entries remain. Forgetting the next one raised
    # KeyError in Billing._refresh, after the new figures were set: the view kept entries
    # that the read already counted (spend counted twice) and never marked itself read.
    view = _OrgView(month_spend=10, project_spend={"p1": 5})
    for seq, cost in enumerate((0, 0, 3, 0), start=1):
        view.settled(seq, "p1", cost)
    view.forget_until(2)
    assert view.spent("p1") == (13, 8, 2)
    view.forget_until(4)
    assert view.spent("p1") == (10, 5, 0) and view.local_by_project == {}


def test_one_member_pools_hash_nothing_and_two_member_pools_do() -> None:
    async def scenario() -> None:
        alone = make_pool(FakeReplica("a"))
        assert alone.hashes(PROMPT, None) == []
        await collect(alone, "r1")
        assert len(alone.affinity) == 0  # type: ignore[arg-type]
        pair = make_pool(FakeReplica("a"), FakeReplica("b"))
        assert len(pair.hashes(PROMPT, None)) == len(PROMPT) // 16
        await collect(pair, "r2")
        assert len(pair.affinity) == len(PROMPT) // 16  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_requests_that_wait_for_the_price_list_wait_for_one_read(tmp_path: Any) -> None:
    """At a cold start (and after a price change) the requests at once share one read of
    the price list; the old code ran one per request (8 at 8 concurrent streams, each a
    round trip through the database's thread: the `billing` stage's cold-start tens of
    ms). Over a real SQLite store."""
    from tokenyard.gateway.billing import Billing
    from tokenyard.store import Database, LedgerWriter, Prices, Store

    async def scenario() -> None:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'p.db'}")
        store = Store(db)
        ledger = LedgerWriter(db, tmp_path / "journal")
        try:
            await store.set_price("m", input=1, cached_input=1, output=2)
            reads: list[int] = []
            read = store.prices

            async def counted() -> Any:
                reads.append(1)
                return await read()

            store.prices = counted  # type: ignore[method-assign]
            billing = Billing(store, ledger)
            first = await asyncio.gather(*(billing.prices("m") for _ in range(8)))
            assert first == [Prices(1, 1, 2)] * 8 and len(reads) == 1
            assert await billing.prices("m") == Prices(1, 1, 2) and len(reads) == 1
            await store.set_price("m", input=3, cached_input=3, output=4)
            changed = await asyncio.gather(*(billing.prices("m") for _ in range(8)))
            assert changed == [Prices(3, 3, 4)] * 8 and len(reads) == 2
        finally:
            await db.close()

    asyncio.run(scenario())
