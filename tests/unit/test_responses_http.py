"""Stored responses over HTTP, in process: the real application (`make_app`, its middleware
and authentication) over a real SQLite store, called with the official `openai` SDK.

No model is needed: responses are stored through `remember` — the call `POST /v1/responses`
makes — from a small route this test adds, which also calls `expand_previous` the way
`POST /v1/responses` does for a `previous_response_id`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from tests.unit.test_responses_store import response
from tokenyard.api.app import make_app
from tokenyard.api.context import AppState
from tokenyard.api.responses.stored import expand_previous, remember
from tokenyard.deployments import FleetSpec
from tokenyard.gateway.billing import Billing
from tokenyard.gateway.gate import Gateway
from tokenyard.gateway.limits import InProcessLimiter
from tokenyard.gateway.routing import Router
from tokenyard.store import Database, LedgerWriter, Scopes, Store

TURN = "/test/turn"


async def turn(request: web.Request) -> web.Response:
    """What `POST /v1/responses` does with the store: expand the previous response, then
    remember the new one with its input items."""
    body = await request.json()
    previous = body["response"].get("previous_response_id")
    history = await expand_previous(request, previous) if previous else []
    await remember(request, body["response"], body["input"])
    return web.json_response({"history": history})


@asynccontextmanager
async def serving(tmp_path: Path, *, auth: bool = True) -> AsyncIterator[tuple[str, list[str]]]:
    """The app on a free port: its base URL and the secrets of org A, org B, an admin."""
    gateway = None
    secrets: list[str] = []
    if auth:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'state.db'}")
        store = Store(db)
        gateway = Gateway(store, InProcessLimiter(),
                          Billing(store, LedgerWriter(db, tmp_path / "journal")))
        a, b = await store.create_org("a"), await store.create_org("b")
        for org, scopes in ((a, Scopes()), (b, Scopes()), (b, Scopes(admin=True))):
            secrets.append((await store.create_api_key(org.id, name="k", scopes=scopes))[0])
    state = AppState({}, Router(FleetSpec({})), 0, gateway=gateway)
    app = make_app(state)
    app.router.add_post(TURN, turn)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", secrets
    finally:
        await runner.cleanup()
        if gateway is not None:
            await gateway.store.db.close()


async def post_turn(base: str, secret: str, resp: dict[str, Any],
                    items: list[dict[str, Any]]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(
        base + TURN, json={"response": resp, "input": items},
        headers={"authorization": f"Bearer {secret}"},
    ) as r:
        return r.status, await r.json()


def sdk(base: str, secret: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=secret, max_retries=0)


def run(tmp_path: Path, scenario: Callable[[str, list[str]], Awaitable[None]],
        auth: bool = True) -> None:
    async def main() -> None:
        async with serving(tmp_path, auth=auth) as (base, secrets):
            await scenario(base, secrets)

    asyncio.run(main())


def test_retrieve_list_input_items_and_delete_with_the_openai_sdk(tmp_path: Path) -> None:
    async def scenario(base: str, secrets: list[str]) -> None:
        a, b, admin = (sdk(base, s) for s in secrets)
        items = [{"role": "user", "content": f"q{i}"} for i in range(5)]
        status, _ = await post_turn(base, secrets[0], response("resp_1", "hi"), items)
        assert status == 200
        got = await a.responses.retrieve("resp_1")
        assert (got.id, got.output_text, got.object) == ("resp_1", "hi", "response")
        assert (await admin.responses.retrieve("resp_1")).id == "resp_1"
        with pytest.raises(openai.NotFoundError) as other_org:
            await b.responses.retrieve("resp_1")
        assert other_org.value.body == {
            "message": "No response found with id 'resp_1'.",
            "type": "invalid_request_error", "param": None, "code": "not_found"}

        listed = await a.responses.input_items.list("resp_1")  # default: newest first
        texts = [item.content[0].text for item in listed.data]  # type: ignore[union-attr]
        assert texts == ["q4", "q3", "q2", "q1", "q0"] and not listed.has_more
        assert all(item.id.startswith("msg_") for item in listed.data)
        first = await a.responses.input_items.list("resp_1", limit=2, order="asc")
        assert [i.content[0].text for i in first.data] == ["q0", "q1"]  # type: ignore[union-attr]
        assert first.has_more and first.last_id == first.data[1].id
        rest = await a.responses.input_items.list("resp_1", order="asc",
                                                  after=first.last_id)  # type: ignore[arg-type]
        assert [i.content[0].text for i in rest.data] == ["q2", "q3", "q4"]  # type: ignore[union-attr]
        for bad, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                           ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")):
            with pytest.raises(openai.BadRequestError) as refused:
                await a.responses.input_items.list("resp_1", **bad)  # type: ignore[arg-type]
            assert refused.value.body["param"] == param  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            await b.responses.input_items.list("resp_1")

        with pytest.raises(openai.NotFoundError):
            await b.responses.delete("resp_1")  # another org's: untouched
        async with aiohttp.ClientSession() as session, session.delete(
            base + "/v1/responses/resp_1", headers={"authorization": f"Bearer {secrets[0]}"},
        ) as r:
            assert (r.status, await r.json()) == (
                200, {"id": "resp_1", "object": "response.deleted", "deleted": True})
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve("resp_1")
        with pytest.raises(openai.NotFoundError):
            await a.responses.delete("resp_1")
        with pytest.raises(openai.AuthenticationError):
            await sdk(base, "sk-ty-wrong").responses.retrieve("resp_1")

    run(tmp_path, scenario)


def test_a_follow_up_sees_the_conversation_and_a_foreign_id_is_a_400(tmp_path: Path) -> None:
    async def scenario(base: str, secrets: list[str]) -> None:
        first = [{"role": "user", "content": "one"}]
        assert (await post_turn(base, secrets[0], response("resp_1", "1"), first))[0] == 200
        status, body = await post_turn(base, secrets[0], response("resp_2", "2", "resp_1"),
                                       [{"role": "user", "content": "two"}])
        assert status == 200
        history = body["history"]
        assert [(i["role"], i["content"][0]["text"]) for i in history] == [
            ("user", "one"), ("assistant", "1")]
        status, body = await post_turn(base, secrets[1], response("resp_3", "3", "resp_2"), [])
        assert status == 400 and body["error"] == {
            "message": "Previous response with id 'resp_2' not found.",
            "type": "invalid_request_error", "param": "previous_response_id",
            "code": "previous_response_not_found"}

    run(tmp_path, scenario)


def test_without_a_store_nothing_is_found_and_previous_ids_are_refused(tmp_path: Path) -> None:
    async def scenario(base: str, _: list[str]) -> None:
        client = sdk(base, "unused")
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.retrieve("resp_1")
        assert "--no-auth" in missing.value.message
        status, body = await post_turn(base, "unused", response("resp_2", "2", "resp_1"), [])
        assert status == 400 and body["error"]["param"] == "previous_response_id"
        assert "--no-auth" in body["error"]["message"]
        status, _ = await post_turn(base, "unused", response("resp_3", "3"), [])
        assert status == 200  # remembering is a no-op

    run(tmp_path, scenario, auth=False)
