"""Background responses on a running `tokenyard serve`, through the official `openai`
SDK: `background=True` answers at once with the response queued; polling `retrieve`
sees it in progress, then completed, stored like any response (a later turn continues
it, its input items are listed) and billed once under its id; a streamed one resumes
with `starting_after`; `cancel` stops one in flight; another org sees none of it; a key
whose org has no money gets a failed response, not a hang. Every body and event is
validated against the Open Responses spec."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conformance.test_responses import _event_components, _open, _resolved
from tests.e2e.conftest import Server
from tests.e2e.test_admin_http import _call
from tests.e2e.test_responses_store import client, other_org  # noqa: F401 (fixtures)
from tests.integration.test_workers import poll

pytestmark = pytest.mark.slow


def valid(body: dict[str, Any], what: str) -> dict[str, Any]:
    """`body` (the JSON the server sent), validated against Open Responses' response."""
    _open().validate(_resolved(body, what), "ResponseResource", what)
    return body


def retrieved(api: openai.OpenAI, response_id: str) -> openai.types.responses.Response:
    """The response as GET returns it now, its body validated."""
    raw = api.responses.with_raw_response.retrieve(response_id)
    response = raw.parse()
    valid(raw.http_response.json(), str(response.status))
    return response


def ended(api: openai.OpenAI, response_id: str) -> openai.types.responses.Response:
    """The response, polled until it is no longer queued or in progress."""
    return poll(lambda: retrieved(api, response_id),
                lambda r: r.status not in ("queued", "in_progress"), 120, "its end")


def test_a_background_response_is_queued_polled_stored_and_billed_once(
        client: openai.OpenAI, server: Server) -> None:  # noqa: F811
    raw = client.responses.with_raw_response.create(
        model=server.model, input="Name a colour.", background=True, max_output_tokens=8,
        metadata={"run": "bg"})
    queued = raw.parse()
    valid(raw.http_response.json(), "queued")
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    seen = {queued.status}
    deadline = time.monotonic() + 120
    while True:
        now = retrieved(client, queued.id)
        seen.add(now.status)
        if now.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert now.status in ("completed", "incomplete"), now
    assert now.id == queued.id and now.created_at == queued.created_at
    assert now.output_text and now.usage is not None and now.metadata == {"run": "bg"}

    # Stored like a live response: its input items, and a turn that continues it.
    items = client.responses.input_items.list(queued.id).data
    assert [i.type for i in items] == ["message"]
    later = client.responses.create(model=server.model, input="Another?",
                                    previous_response_id=queued.id, max_output_tokens=2)
    assert later.usage is not None and later.usage.input_tokens > now.usage.input_tokens

    assert server.state_dir is not None
    db = Path(server.state_dir) / "tokenyard.db"

    def rows() -> list[tuple[Any, ...]]:
        with sqlite3.connect(db) as conn:
            return conn.execute("SELECT output_tokens FROM usage_ledger WHERE request_id = ?",
                                (queued.id,)).fetchall()

    assert poll(rows, bool, 30, "its ledger row") == [(now.usage.output_tokens,)]


def test_a_streamed_background_response_resumes_after_a_sequence_number(
        client: openai.OpenAI, server: Server) -> None:  # noqa: F811
    components = _event_components()
    first: list[Any] = []
    with client.responses.create(model=server.model, input="Count to five.",
                                 background=True, stream=True, max_output_tokens=16,
                                 temperature=0) as events:
        for event in events:
            first.append(event)
            if len(first) == 6:
                break  # the client goes away mid-stream
    assert [e.type for e in first[:3]] == ["response.created", "response.queued",
                                           "response.in_progress"]
    assert first[0].response.status == "queued" and first[0].response.background
    response_id = first[0].response.id
    done = ended(client, response_id)
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=5))
    assert [e.sequence_number for e in rest] == list(range(6, 6 + len(rest)))
    assert rest[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in [*first, *rest] if e.type == "response.output_text.delta")
    assert text == done.output_text
    # The whole stream again, every event valid against its schema.
    with httpx.stream("GET", f"{server.base_url}/v1/responses/{response_id}?stream=true",
                      headers=server.headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        whole = [line for line in r.iter_lines() if line.startswith("data: ")]
    for line in whole:
        event = json.loads(line[6:])
        _open().validate(_resolved(event, event["type"]), components[event["type"]],
                         event["type"])
    assert len(whole) == 6 + len(rest)


def test_cancel_stops_a_background_response(
        client: openai.OpenAI, other_org: openai.OpenAI, server: Server) -> None:  # noqa: F811
    long = client.responses.create(model=server.model, input="Write a long essay.",
                                   background=True, max_output_tokens=400)
    poll(lambda: client.responses.retrieve(long.id), lambda r: r.status == "in_progress",
         60, "in progress")
    with pytest.raises(openai.NotFoundError):
        other_org.responses.cancel(long.id)
    raw = client.responses.with_raw_response.cancel(long.id)
    cancelled = raw.parse()
    valid(raw.http_response.json(), "cancelled")
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"  # again: the same
    # Its stream ends (no cancelled event exists): nothing after the cancel hangs.
    list(client.responses.retrieve(long.id, stream=True, starting_after=1))
    # Its record says its client cancelled it, with what it had used.
    record = _record(server, long.id)
    assert (record["status"], record["error_code"]) == (499, "response_cancelled")
    assert record["tokens"]["prompt"] > 0

    done = client.responses.create(model=server.model, input="Hi", background=True,
                                   max_output_tokens=2)
    assert ended(client, done.id).status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(done.id)
    live = client.responses.create(model=server.model, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(live.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nothere")


def test_another_org_sees_no_background_response_and_refusals_are_400s(
        client: openai.OpenAI, other_org: openai.OpenAI, server: Server) -> None:  # noqa: F811
    made = client.responses.create(model=server.model, input="Hi", background=True,
                                   max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        other_org.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        other_org.responses.retrieve(made.id, stream=True)
    with pytest.raises(openai.BadRequestError) as stored:
        client.responses.create(model=server.model, input="Hi", background=True,
                                store=False)
    assert stored.value.param == "store"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi", background=True)
    ended(client, made.id)
    assert client.responses.delete(made.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


def test_a_background_turn_is_admitted_under_the_key_an_empty_balance_fails_it(
        server: Server) -> None:
    async def broke_key() -> str:
        status, org = await _call(server, "POST", "/admin/v1/orgs",
                                  body={"name": "broke", "balance": "0"})
        assert status == 201, org
        status, key = await _call(server, "POST", "/admin/v1/keys",
                                  body={"org_id": org["id"], "name": "broke"})
        assert status == 201, key
        return str(key["secret"])

    broke = openai.OpenAI(base_url=server.base_url + "/v1", api_key=asyncio.run(broke_key()),
                          max_retries=0)
    made = broke.responses.create(model=server.model, input="Hi", background=True,
                                  max_output_tokens=2)
    failed = ended(broke, made.id)
    assert failed.status == "failed" and failed.error is not None
    assert "balance" in failed.error.message


def _request_id(line: str) -> str | None:
    """The request id of a JSON log line (None: another kind of line)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("request_id") if isinstance(record, dict) else None


def _record(server: Server, request_id: str, key: str | None = None) -> dict[str, Any]:
    """`GET /v1/requests/{id}` once the request's record is there."""
    headers = {"Authorization": f"Bearer {key or server.api_key}"}
    r = poll(lambda: httpx.get(f"{server.base_url}/v1/requests/{request_id}",
                               headers=headers, timeout=10),
             lambda r: r.status_code == 200, 30, "its request record")
    return dict(r.json())


def test_a_background_response_ends_as_a_live_request_with_its_request_record(
        client: openai.OpenAI, server: Server) -> None:  # noqa: F811
    made = client.responses.create(model=server.model, input="Name a fruit.",
                                   background=True, max_output_tokens=6)
    done = ended(client, made.id)
    assert done.status in ("completed", "incomplete") and done.usage is not None
    record = _record(server, made.id)
    assert (record["endpoint"], record["status"], record["error_code"]) == (
        "/v1/responses", 200, None)
    assert record["model"] == server.model and record["deployment"] is not None
    assert record["lane"] == "background"
    assert record["tokens"] == {"prompt": done.usage.input_tokens,
                                "cached": done.usage.input_tokens_details.cached_tokens,
                                "output": done.usage.output_tokens}
    assert record["cost"] is not None  # the ledger row's charge
    assert poll(lambda: [line for line in server.output if _request_id(line) == made.id],
                bool, 10, "its log line")

    # One refused (its org has no money) ends with its record too: the refusal's code.
    async def broke_key() -> str:
        status, org = await _call(server, "POST", "/admin/v1/orgs",
                                  body={"name": "broke-record", "balance": "0"})
        assert status == 201, org
        status, key = await _call(server, "POST", "/admin/v1/keys",
                                  body={"org_id": org["id"]})
        assert status == 201, key
        return str(key["secret"])

    secret = asyncio.run(broke_key())
    broke = openai.OpenAI(base_url=server.base_url + "/v1", api_key=secret, max_retries=0)
    failed = broke.responses.create(model=server.model, input="Hi", background=True,
                                    max_output_tokens=2)
    assert ended(broke, failed.id).status == "failed"
    refused = _record(server, failed.id, secret)
    assert (refused["status"], refused["error_code"]) == (429, "insufficient_quota")
