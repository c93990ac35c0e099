"""Stored responses at the gateway: save and read back, org scoping, the
`previous_response_id` chain, delete, input-item paging, and expiry and its purge.

Tests that take `database_url` are backend-neutral: tests/integration/test_store_postgres.py
runs them again on PostgreSQL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import func, select

from tests.unit.test_store import FakeClock
from tokenyard.errors import APIError
from tokenyard.gateway.responses import (
    ChainTooLong,
    ResponseNotFound,
    StoredResponses,
    UnknownItem,
    page,
)
from tokenyard.store import Database, KeyContext, Limits, Scopes, Store
from tokenyard.store.tables import stored_responses

T = TypeVar("T")
DAY_S = 86_400.0


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'state' / 'tokenyard.db'}"


class World:
    """A store with two orgs: a key of each, and an admin key of the second."""

    def __init__(self, store: Store, responses: StoredResponses) -> None:
        self.store = store
        self.responses = responses
        self.a: KeyContext
        self.b: KeyContext
        self.admin: KeyContext

    async def keys(self) -> World:
        found = []
        a, b = await self.store.create_org("a"), await self.store.create_org("b")
        for org, scopes in ((a, Scopes()), (b, Scopes()), (b, Scopes(admin=True))):
            secret, _ = await self.store.create_api_key(org.id, name="k", scopes=scopes)
            found.append(await self.store.find_key(secret))
        self.a, self.b, self.admin = found  # type: ignore[assignment]
        return self

    async def rows(self) -> int:
        async with self.store.db.engine.connect() as conn:
            return (await conn.execute(
                select(func.count()).select_from(stored_responses))).scalar_one()


def run(url: str, scenario: Callable[[World], Awaitable[T]], *, clock: FakeClock | None = None,
        retention_days: float = 30.0, purge_every_s: float = 300.0) -> T:
    async def main() -> T:
        db = await Database.open(url)
        store = Store(db, clock) if clock else Store(db)
        responses = StoredResponses(store, retention_days=retention_days,
                                    purge_every_s=purge_every_s)
        try:
            return await scenario(await World(store, responses).keys())
        finally:
            await responses.close()
            await db.close()

    return asyncio.run(main())


def response(rid: str, text: str, previous: str | None = None) -> dict[str, Any]:
    """A response object as `POST /v1/responses` returns it (the parts the store reads)."""
    return {
        "id": rid, "object": "response", "status": "completed", "model": "m",
        "previous_response_id": previous,
        "output": [{"id": f"msg_{rid}", "type": "message", "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
    }


def test_a_saved_response_is_read_back_by_its_org_and_by_admins_only(database_url: str) -> None:
    async def scenario(w: World) -> None:
        items = await w.responses.save(w.a, response("resp_1", "hi!"), [
            {"role": "system", "content": "be brief"},
            {"type": "message", "role": "user", "id": "msg_mine",
             "content": [{"type": "input_text", "text": "hello"}]},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        ])
        found = await w.responses.get(w.a, "resp_1")
        assert found is not None and found.response == response("resp_1", "hi!")
        assert found.input_items == items
        assert (found.org_id, found.key_id) == (w.a.org_id, w.a.key_id)
        # Every item has an id (the client's own kept); text content became a part list.
        assert items[0]["id"].startswith("msg_") and len(items[0]["id"]) == 52
        assert items[0]["type"] == "message"
        assert items[0]["content"] == [{"type": "input_text", "text": "be brief"}]
        assert items[1]["id"] == "msg_mine"
        assert items[2]["id"].startswith("fco_")
        assert len({item["id"] for item in items}) == 3
        assert await w.responses.get(w.b, "resp_1") is None  # another org: not found
        admin_view = await w.responses.get(w.admin, "resp_1")
        assert admin_view is not None and admin_view.id == "resp_1"
        assert await w.responses.get(w.a, "resp_nope") is None
        assert await w.responses.get(w.a, "resp_" + "x" * 300) is None  # longer than the column

    run(database_url, scenario)


def test_a_chain_expands_oldest_turn_first_inputs_before_outputs(database_url: str) -> None:
    async def scenario(w: World) -> None:
        await w.responses.save(w.a, response("resp_1", "one"), [{"role": "user", "content": "1"}])
        await w.responses.save(w.a, response("resp_2", "two", "resp_1"),
                               [{"role": "user", "content": "2"}])
        await w.responses.save(w.a, response("resp_3", "three", "resp_2"),
                               [{"role": "user", "content": "3"}])
        items = await w.responses.conversation(w.a, "resp_3")
        texts = [item["content"][0]["text"] for item in items]
        assert texts == ["1", "one", "2", "two", "3", "three"]
        assert [item["role"] for item in items] == ["user", "assistant"] * 3
        assert await w.responses.conversation(w.admin, "resp_2") == items[:4]
        with pytest.raises(ResponseNotFound) as other_org:
            await w.responses.conversation(w.b, "resp_3")
        assert other_org.value.response_id == "resp_3"
        with pytest.raises(ChainTooLong):
            await w.responses.conversation(w.a, "resp_3", max_turns=2)
        assert len(await w.responses.conversation(w.a, "resp_3", max_turns=3)) == 6
        # A deleted turn breaks the chain after it: its id is the one reported missing.
        assert await w.responses.delete(w.a, "resp_2")
        with pytest.raises(ResponseNotFound) as broken:
            await w.responses.conversation(w.a, "resp_3")
        assert broken.value.response_id == "resp_2"

    run(database_url, scenario)


def test_delete_is_org_scoped_and_happens_once(database_url: str) -> None:
    async def scenario(w: World) -> None:
        await w.responses.save(w.a, response("resp_1", "x"), [])
        assert not await w.responses.delete(w.b, "resp_1")  # another org's: not found
        assert await w.responses.get(w.a, "resp_1") is not None
        assert await w.responses.delete(w.a, "resp_1")
        assert not await w.responses.delete(w.a, "resp_1")
        assert await w.responses.get(w.a, "resp_1") is None
        with pytest.raises(ResponseNotFound):
            await w.responses.conversation(w.a, "resp_1")
        assert await w.rows() == 0

    run(database_url, scenario)


def test_an_expired_response_is_not_served_and_the_purge_deletes_only_it(
    database_url: str,
) -> None:
    clock = FakeClock(datetime(2026, 1, 1, tzinfo=UTC))

    async def scenario(w: World) -> None:
        await w.responses.save(w.a, response("resp_old", "x"), [])
        clock.advance(1.5 * DAY_S)
        await w.responses.save(w.a, response("resp_new", "y", "resp_old"), [])
        clock.advance(0.6 * DAY_S)  # resp_old is 2.1 days old, resp_new 0.6
        assert await w.responses.get(w.a, "resp_old") is None
        assert await w.responses.get(w.admin, "resp_old") is None
        assert not await w.responses.delete(w.a, "resp_old")
        assert await w.responses.get(w.a, "resp_new") is not None
        with pytest.raises(ResponseNotFound) as gone:
            await w.responses.conversation(w.a, "resp_new")
        assert gone.value.response_id == "resp_old"
        assert await w.rows() == 2  # not served, but still there until the purge
        assert await w.responses.purge() == 1
        assert await w.rows() == 1
        assert await w.responses.get(w.a, "resp_new") is not None

    run(database_url, scenario, clock=clock, retention_days=2.0)


def test_the_background_purge_runs_at_start_and_then_periodically(tmp_path: Path) -> None:
    async def scenario(w: World) -> tuple[int, int]:
        await w.responses.save(w.a, response("resp_1", "x"), [])
        await asyncio.sleep(0.3)  # its retention (~0.09 s) is over
        w.responses.start()
        for _ in range(100):
            if await w.rows() == 0:
                break
            await asyncio.sleep(0.02)
        at_start = await w.rows()
        await w.responses.save(w.a, response("resp_2", "y"), [])
        for _ in range(100):  # a later round deletes the next one without a restart
            if await w.rows() == 0:
                break
            await asyncio.sleep(0.05)
        return at_start, await w.rows()

    url = f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    assert run(url, scenario, retention_days=0.1 / DAY_S, purge_every_s=0.2) == (0, 0)


def test_a_failing_store_is_a_503_to_retry_never_a_500(tmp_path: Path) -> None:
    async def main() -> list[APIError]:
        # A database that was never migrated: every query fails for real.
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}", upgrade=False)
        responses = StoredResponses(Store(db), retention_days=1.0)
        key = KeyContext("key_x", "k", "sk-ty-x", "org_x", None, None, Scopes(), Limits(),
                         Limits(), None, None, None)
        errors = []
        try:
            for call in (responses.get(key, "resp_1"), responses.delete(key, "resp_1"),
                         responses.conversation(key, "resp_1"),
                         responses.save(key, response("resp_1", "x"), [])):
                with pytest.raises(APIError) as refused:
                    await call
                errors.append(refused.value)
        finally:
            await db.close()
        return errors

    errors = asyncio.run(main())
    assert [(e.status, e.headers["retry-after"]) for e in errors] == [(503, "1")] * 4


ITEMS = [{"id": f"item_{i}"} for i in range(5)]


@pytest.mark.parametrize(
    ("kwargs", "ids", "has_more"),
    [
        ({"limit": 20, "order": "desc"}, [4, 3, 2, 1, 0], False),
        ({"limit": 2, "order": "desc"}, [4, 3], True),
        ({"limit": 2, "order": "asc"}, [0, 1], True),
        ({"limit": 2, "order": "asc", "after": "item_1"}, [2, 3], True),
        ({"limit": 2, "order": "asc", "after": "item_2"}, [3, 4], False),
        ({"limit": 2, "order": "desc", "after": "item_3"}, [2, 1], True),
        ({"limit": 2, "order": "asc", "before": "item_4"}, [2, 3], True),
        ({"limit": 5, "order": "asc", "before": "item_2"}, [0, 1], False),
        ({"limit": 5, "order": "asc", "after": "item_0", "before": "item_3"}, [1, 2], False),
        ({"limit": 5, "order": "asc", "after": "item_4"}, [], False),
    ],
)
def test_input_items_page_in_either_order_from_either_cursor(
    kwargs: dict[str, Any], ids: list[int], has_more: bool,
) -> None:
    data, more = page(ITEMS, **kwargs)
    assert [item["id"] for item in data] == [f"item_{i}" for i in ids]
    assert more is has_more


def test_a_cursor_naming_no_item_is_refused_naming_its_parameter() -> None:
    with pytest.raises(UnknownItem) as unknown:
        page(ITEMS, limit=2, order="asc", before="item_9")
    assert (unknown.value.param, unknown.value.item_id) == ("before", "item_9")
