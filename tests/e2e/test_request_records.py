"""What a request cost and how it went, against one `tokenyard serve` of this module's own
(prices set through `/admin/v1`, the official SDKs and raw HTTP as clients): the `cost`
beside `timings` in bodies and streams, equal to the ledger's charge; `GET
/v1/requests/{id}` for the owning org only; body capture turned on and off over HTTP,
with redaction. (The purge job is tested in tests/unit/test_request_records.py.)"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from tests.e2e.conftest import Server, running_server
from tests.e2e.test_admin_http import call

pytestmark = pytest.mark.slow

#: Odd prices per million tokens, so that rounding shows (micros: 2_500_001, …).
PRICES = {"input": "2.500001", "cached_input": "1.250003", "output": "10.000007"}
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    with running_server() as (server, _):
        status, _ = call(server, "PUT", f"/admin/v1/prices/{server.model}", body=PRICES)
        assert status == 200
        yield server


def new_key(server: Server, **org: Any) -> tuple[str, str]:
    """A fresh org and a key of it: (secret, org id)."""
    status, made = call(server, "POST", "/admin/v1/orgs", body={"name": "rr", **org})
    assert status == 201, made
    status, key = call(server, "POST", "/admin/v1/keys", body={"org_id": made["id"]})
    assert status == 201, key
    return key["secret"], made["id"]


def ledger_cost(server: Server, org_id: str, requests: int) -> str:
    """The org's charged total once its `requests` ledger rows landed (off the path)."""
    deadline = time.monotonic() + 10
    while True:
        status, body = call(server, "GET", f"/admin/v1/usage?group_by=org&org_id={org_id}")
        assert status == 200
        rows = body["data"]
        if rows and rows[0]["requests"] >= requests:
            assert rows[0]["requests"] == requests
            return str(rows[0]["cost"])
        assert time.monotonic() < deadline, f"no ledger rows for {org_id}: {rows}"
        time.sleep(0.05)


def sse_events(raw: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _cost_sum(costs: list[dict[str, str]]) -> str:
    return f"{sum(Decimal(c['total']) for c in costs):.6f}"


def test_bodies_and_last_events_carry_the_cost_the_ledger_charges(srv: Server) -> None:
    secret, org_id = new_key(srv)
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=secret, max_retries=0)
    reply = client.chat.completions.create(model=srv.model, messages=HELLO, max_tokens=4)
    extra = reply.model_extra or {}
    cost, timings = extra["cost"], extra["timings"]
    assert timings["decode"] >= 0 and "tokenize" in timings
    assert cost["currency"] == "USD" and Decimal(cost["total"]) > 0
    # The line items are exact; the total is their sum rounded once to the micro.
    items = sum(Decimal(cost[k]) for k in ("input", "cached_input", "output"))
    assert abs(items - Decimal(cost["total"])) <= Decimal("0.0000005")
    usage = reply.usage
    assert usage is not None
    assert Decimal(cost["output"]) == usage.completion_tokens * Decimal("10.000007") / 10**6

    costs = [cost]
    chunks = list(client.chat.completions.create(
        model=srv.model, messages=HELLO, max_tokens=3, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1].model_extra or {}
    assert chunks[-1].usage is not None and "timings" in last
    costs.append(last["cost"])
    assert all("cost" not in (c.model_extra or {}) for c in chunks[:-1])

    claude = anthropic.Anthropic(base_url=srv.base_url, api_key=secret, max_retries=0)
    message = claude.messages.create(model=srv.model, messages=HELLO, max_tokens=2)
    costs.append((message.model_extra or {})["cost"])
    costs.append(_stream_cost(srv, secret))
    answer = client.responses.create(model=srv.model, input="Say hello.", max_output_tokens=2,
                                     store=False)
    costs.append((answer.model_extra or {})["cost"])
    assert ledger_cost(srv, org_id, len(costs)) == _cost_sum(costs)


def _stream_cost(srv: Server, secret: str) -> dict[str, str]:
    """A raw streamed /v1/messages: its message_stop event's cost."""
    async def main() -> str:
        async with aiohttp.ClientSession() as session, session.post(
            srv.base_url + "/v1/messages", headers={"x-api-key": secret},
            json={"model": srv.model, "messages": HELLO, "max_tokens": 2, "stream": True},
        ) as r:
            assert r.status == 200
            return await r.text()

    events = sse_events(asyncio.run(main()))
    assert events[-1]["type"] == "message_stop"
    return dict(events[-1]["cost"])


def get_record(srv: Server, request_id: str, key: str) -> tuple[int, Any]:
    return call(srv, "GET", f"/v1/requests/{request_id}", key=key)


def test_get_request_shows_the_owning_org_its_timeline_tokens_and_cost(srv: Server) -> None:
    secret, org_id = new_key(srv)
    other, _ = new_key(srv)
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=secret, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=srv.model, messages=HELLO, max_tokens=3)
    request_id, reply = raw.headers["x-request-id"], raw.parse()
    status, record = get_record(srv, request_id, secret)
    assert status == 200, record
    usage = reply.usage
    assert usage is not None
    assert record["id"] == request_id and record["org_id"] == org_id
    assert record["tokens"] == {"prompt": usage.prompt_tokens,
                                "cached": usage.prompt_tokens_details.cached_tokens,
                                "output": usage.completion_tokens}
    assert record["cost"]["total"] == (reply.model_extra or {})["cost"]["total"]
    # Where it ran is an internal address: the admin's to see, not the tenant's.
    assert record["deployment"] == srv.model and record["replica"] is None
    assert record["status"] == 200 and record["finish_reason"] in ("stop", "length")
    assert {"queue", "prefill", "decode"} <= set(record["timeline"])
    assert record["capture"] is None  # capture is off by default

    # Another org's key, and an unknown id, get the same 404 in OpenAI's shape.
    for key, rid in ((other, request_id), (secret, "req_does_not_exist")):
        status, err = get_record(srv, rid, key)
        assert status == 404 and err["error"]["code"] == "not_found"
    status, as_admin = get_record(srv, request_id, srv.api_key or "")  # the admin: any org
    assert status == 200 and as_admin["replica"] == srv.replica_url


def test_capture_on_stores_redacted_bodies_and_off_stores_none(srv: Server) -> None:
    secret, org_id = new_key(srv)
    status, setting = call(srv, "POST", f"/admin/v1/orgs/{org_id}/capture",
                           body={"retention_days": 2})
    assert status == 200 and setting == {"org_id": org_id, "capture": True,
                                         "retention_days": 2}
    card = "4111 1111 1111 1111"
    messages = [{"role": "user", "content": f"My card is {card}, mail me at a@b.example."}]
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=secret, max_retries=0)
    plain = client.chat.completions.with_raw_response.create(
        model=srv.model, messages=messages, max_tokens=3)
    streamed = client.chat.completions.with_raw_response.create(
        model=srv.model, messages=messages, max_tokens=3, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)
    for raw, content in ((plain, plain.parse().choices[0].message.content), (streamed, text)):
        status, record = get_record(srv, raw.headers["x-request-id"], secret)
        assert status == 200
        capture = record["capture"]
        sent = capture["request"]["messages"][0]["content"]
        assert sent == "My card is [REDACTED:card], mail me at [REDACTED:email]."
        assert card not in json.dumps(capture)
        # A stream is captured as the body its deltas make.
        assert capture["response"]["choices"][0]["message"]["content"] == content
        assert capture["response"]["cost"]["total"] == record["cost"]["total"]

    status, _ = call(srv, "POST", f"/admin/v1/orgs/{org_id}/capture", body={"enabled": False})
    assert status == 200
    after = client.chat.completions.with_raw_response.create(
        model=srv.model, messages=messages, max_tokens=1)
    status, record = get_record(srv, after.headers["x-request-id"], secret)
    assert status == 200 and record["capture"] is None
