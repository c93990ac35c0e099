"""Conversations at the gateway: org scoping, metadata, and appends that race. Tests that
take `database_url` are backend-neutral: tests/integration/test_store_postgres.py runs
them again on PostgreSQL."""

from __future__ import annotations

import asyncio

from tests.unit.test_responses_store import World, database_url, run  # noqa: F401
from tokenyard.gateway.conversations import Conversations


def test_racing_appends_all_land_and_other_orgs_see_nothing(
    database_url: str,  # noqa: F811
) -> None:
    async def scenario(w: World) -> None:
        conversations = Conversations(w.store)
        made = await conversations.create(w.a, {"k": "v"}, [{"role": "user", "content": "hi"}])
        assert await conversations.get(w.b, made.id) is None
        assert await conversations.add_items(w.b, made.id, [{"role": "user",
                                                              "content": "x"}]) is None
        assert not await conversations.delete(w.b, made.id)
        found = await conversations.get(w.admin, made.id)  # an admin sees every org's
        assert found is not None and found.metadata == {"k": "v"}
        texts = [f"turn {n}" for n in range(8)]
        await asyncio.gather(*(conversations.add_items(w.a, made.id, [
            {"role": "user", "content": text}]) for text in texts))
        after = await conversations.get(w.a, made.id)
        assert after is not None and len(after.items) == 9
        assert sorted(item["content"][0]["text"] for item in after.items[1:]) == texts
        changed, held = await conversations.delete_item(w.a, made.id, after.items[0]["id"])
        assert held and changed is not None and len(changed.items) == 8
        assert (await conversations.delete_item(w.a, made.id, "msg_none"))[1] is False
        assert await conversations.delete(w.a, made.id)
        assert await conversations.get(w.a, made.id) is None

    run(database_url, scenario)
