"""Fallbacks (issue 41 part 4) through HTTP with the official SDKs: a `tokenyard serve
--config` (auth on: keys, scopes, billing, the ledger and the request records are real)
over the session's embedded model (its replica, as the deployment `embedded-2026`) and
the project's mock OpenAI servers as upstreams that answer 429, 500 or break off their
stream, plus a fake upstream on 127.0.0.1 that sends nothing for seconds.

Each test names the request's path through its candidates and checks what the client got
(the body valid against the spec, its `model` the deployment that served), the request
record's attempts, and the ledger: one row, for the deployment that served.
"""

from __future__ import annotations

import asyncio
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from aiohttp import web

from tests.conformance.spec import Spec
from tests.conformance.test_anthropic import valid_message
from tests.conformance.test_openai import valid
from tests.e2e.conftest import Server, running_server
from tests.e2e.test_admin_http import call
from tests.integration.test_canary_shadow import Mocks

pytestmark = pytest.mark.slow

EMBEDDED = "embedded-2026"
#: How long the fleet's balancer queues a request every replica of its deployment refused.
QUEUE_TIMEOUT_S = 30
HELLO: Any = [{"role": "user", "content": "Say hello."}]


@dataclass
class Fleet:
    server: Server
    mocks: Mocks

    def openai(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.base_url + "/v1", max_retries=0,
                             api_key=key or self.server.api_key)

    def record(self, request_id: str, key: str | None = None) -> dict[str, Any]:
        """`GET /v1/requests/{id}` once the request's record is there."""
        deadline = time.monotonic() + 10
        while True:
            r = httpx.get(f"{self.server.base_url}/v1/requests/{request_id}", timeout=10,
                          headers={"Authorization": f"Bearer {key or self.server.api_key}"})
            if r.status_code == 200:
                return dict(r.json())
            assert time.monotonic() < deadline, (r.status_code, r.text)
            time.sleep(0.05)

    def ledger(self, request_id: str) -> list[dict[str, Any]]:
        """The ledger rows of `request_id`, once there is one (written off the path)."""
        assert self.server.state_dir is not None
        deadline = time.monotonic() + 10
        while True:
            with sqlite3.connect(Path(self.server.state_dir) / "tokenyard.db") as db:
                db.row_factory = sqlite3.Row
                rows = [dict(row) for row in db.execute(
                    "SELECT * FROM usage_ledger WHERE request_id = ?", (request_id,))]
            if rows or time.monotonic() > deadline:
                time.sleep(0.3)  # a second row would come right behind the first
                with sqlite3.connect(Path(self.server.state_dir) / "tokenyard.db") as db:
                    db.row_factory = sqlite3.Row
                    return [dict(row) for row in db.execute(
                        "SELECT * FROM usage_ledger WHERE request_id = ?", (request_id,))]
            time.sleep(0.05)


def _silent_upstream(mocks: Mocks) -> str:
    """An OpenAI-compatible upstream that is healthy but answers a chat with nothing for
    30 s (cut when the client leaves): its base URL."""
    async def chat(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)
        return web.json_response({})

    async def models(request: web.Request) -> web.Response:  # healthy all along
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return mocks.serve(app)


def _fleet_toml(replica_url: str, urls: dict[str, str]) -> str:
    def upstream(name: str, mock: str, extra: str = "") -> str:
        return (f'[[deployments]]\nname = "{name}"\nkind = "upstream"\nmodel = "mock"\n'
                f'urls = ["{urls[mock]}"]\nprices = {{ input = "3.00", output = "6.00" }}\n'
                f"{extra}\n")

    to_embedded = f'fallbacks = ["{EMBEDDED}"]\n'
    return (
        # A full upstream is waited on for up to QUEUE_TIMEOUT_S, unless the request has a
        # fallback that takes rate limits; no ejection: each failure is seen as it happens.
        f"[balancer]\nqueue_timeout_s = {QUEUE_TIMEOUT_S}\neject_after = 1000\n\n"
        f'[[deployments]]\nname = "{EMBEDDED}"\nurls = ["{replica_url}"]\n'
        'prices = { input = "1.00", output = "2.00" }\n\n'
        + upstream("short-2026", "ok", "max_context = 80\n" + to_embedded)
        + upstream("limited-2026", "limited", to_embedded)
        + upstream("broken-2026", "broken", to_embedded + 'fallback_on = ["server_error"]\n')
        + upstream("strict-2026", "broken", to_embedded + 'fallback_on = ["rate_limit"]\n')
        + upstream("cut-2026", "cut", to_embedded)
        + upstream("silent-2026", "silent",
                   'fallbacks = ["ok-2026"]\nfirst_byte_timeout_s = 0.5\n')
        + upstream("guarded-2026", "ok", 'fallbacks = ["ok-2026"]\n'
                   'moderation = { input = "block", classifier = "blocklist", '
                   'patterns = { insult = ["nitwit"] } }\n')
        + upstream("ok-2026", "ok")
    )


@pytest.fixture(scope="module")
def fleet(server: Server) -> Iterator[Fleet]:
    mocks = Mocks()
    try:
        fast = {"output_len": 6, "itl_ms": 0.0}
        urls = {"ok": mocks.start("ok", **fast),
                "limited": mocks.start("limited", inject_429=1.0, **fast),
                "broken": mocks.start("broken", inject_500=1.0, **fast),
                "cut": mocks.start("cut", inject_stream_error=1.0, **fast),
                "silent": _silent_upstream(mocks)}
        with tempfile.TemporaryDirectory(prefix="tokenyard-fallbacks-") as state:
            path = Path(state) / "fleet.toml"
            path.write_text(_fleet_toml(server.replica_url, urls))
            # The session's replica, reached with its token: this server loads no model.
            env = {"TOKENYARD_REPLICA_TOKEN": server.replica_token or ""}
            with running_server("--config", str(path), state_dir=state, env=env) as (srv, _):
                yield Fleet(srv, mocks)
    finally:
        mocks.close()


def _attempts(*tried: tuple[str, str | None, str, str | None]) -> list[dict[str, Any]]:
    return [{"model": m, "deployment": d, "outcome": o, "error_code": c}
            for m, d, o, c in tried]


def test_a_prompt_too_long_for_a_short_window_is_served_by_a_longer_one(
    fleet: Fleet,
) -> None:
    long = [{"role": "user", "content": "Count the words: " + "one two three " * 40}]
    raw = fleet.openai().chat.completions.with_raw_response.create(
        model="short-2026", messages=long, max_tokens=3, temperature=0.0)
    body = valid(raw.http_response, "/chat/completions", "fallen-back chat")  # type: ignore[arg-type]
    assert body["model"] == EMBEDDED
    request_id = raw.headers["x-request-id"]
    record = fleet.record(request_id)
    assert record["attempts"] == _attempts(
        ("short-2026", "short-2026", "failed", "context_length_exceeded"),
        (EMBEDDED, EMBEDDED, "served", None))
    assert (record["model"], record["deployment"], record["status"]) == (EMBEDDED, EMBEDDED,
                                                                         200)
    # A short prompt fits: the deployment serves it itself (its record lists its one
    # attempt: the request had a chain, the fleet file's).
    raw = fleet.openai().chat.completions.with_raw_response.create(
        model="short-2026", messages=HELLO, max_tokens=3)
    assert raw.parse().model == "short-2026"
    assert fleet.record(raw.headers["x-request-id"])["attempts"] == _attempts(
        ("short-2026", "short-2026", "served", None))


@pytest.mark.parametrize(("model", "code"), [("limited-2026", "server_is_overloaded"),
                                             ("broken-2026", "server_is_overloaded")])
def test_an_upstream_answering_429_or_500_falls_back_to_the_embedded_model_billed_once(
    fleet: Fleet, model: str, code: str,
) -> None:
    raw = fleet.openai().chat.completions.with_raw_response.create(
        model=model, messages=HELLO, max_tokens=3)
    reply = raw.parse()
    assert reply.model == EMBEDDED and reply.usage is not None
    request_id = raw.headers["x-request-id"]
    assert fleet.record(request_id)["attempts"] == _attempts(
        (model, model, "failed", code), (EMBEDDED, EMBEDDED, "served", None))
    rows = fleet.ledger(request_id)
    assert [(r["model"], r["prompt_tokens"], r["output_tokens"]) for r in rows] == [
        (EMBEDDED, reply.usage.prompt_tokens, reply.usage.completion_tokens)]


def test_a_content_policy_refusal_falls_back(fleet: Fleet) -> None:
    flagged: Any = [{"role": "user", "content": "Call me a nitwit."}]
    raw = fleet.openai().chat.completions.with_raw_response.create(
        model="guarded-2026", messages=flagged, max_tokens=3)
    assert raw.parse().model == "ok-2026"
    assert fleet.record(raw.headers["x-request-id"])["attempts"] == _attempts(
        ("guarded-2026", "guarded-2026", "failed", "content_policy_violation"),
        ("ok-2026", "ok-2026", "served", None))


def test_a_failure_outside_fallback_on_is_the_answer(fleet: Fleet) -> None:
    # strict-2026's upstream answers 500, but it falls back on rate limits only.
    with pytest.raises(openai.APIStatusError) as info:
        fleet.openai().chat.completions.create(model="strict-2026", messages=HELLO,
                                               max_tokens=3)
    assert info.value.status_code == 503
    request_id = info.value.response.headers["x-request-id"]
    assert fleet.record(request_id)["attempts"] == _attempts(
        ("strict-2026", "strict-2026", "failed", "server_is_overloaded"))
    assert fleet.ledger(request_id) == []


def test_the_requests_own_models_and_fallbacks_replace_the_fleets(fleet: Fleet) -> None:
    client = fleet.openai()
    # OpenRouter's `models` on chat: tried after `model`, instead of its fleet fallbacks.
    raw = client.chat.completions.with_raw_response.create(
        model="limited-2026", messages=HELLO, max_tokens=3,
        extra_body={"models": ["limited-2026", "ok-2026"]})
    assert raw.parse().model == "ok-2026"
    assert fleet.record(raw.headers["x-request-id"])["attempts"] == _attempts(
        ("limited-2026", "limited-2026", "failed", "server_is_overloaded"),
        ("ok-2026", "ok-2026", "served", None))
    # ... and on the Responses API, its body valid against Open Responses.
    raw_response = client.responses.with_raw_response.create(
        model="broken-2026", input="Say hello.", max_output_tokens=3, store=False,
        extra_body={"models": [EMBEDDED]})
    body = raw_response.http_response.json()
    spec = Spec.load("openresponses")
    spec.validate(body, spec.response_schema("/responses", 200), "response")
    assert body["model"] == EMBEDDED
    # A name the fleet does not have is the client's mistake: a 404 naming it.
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="ok-2026", messages=HELLO, max_tokens=3,
                                       extra_body={"models": ["no-such-model"]})
    assert info.value.body["param"] == "models.0"  # type: ignore[index]

    # Anthropic's `fallbacks`: an entry's max_tokens is its attempt's.
    claude = anthropic.Anthropic(base_url=fleet.server.base_url, max_retries=0,
                                 api_key=fleet.server.api_key)
    raw_message = claude.beta.messages.with_raw_response.create(
        model="broken-2026", max_tokens=40, messages=HELLO,
        fallbacks=[{"model": "limited-2026"}, {"model": EMBEDDED, "max_tokens": 2}])
    message = valid_message(raw_message.http_response.json(), "fallen-back message")
    assert message["model"] == EMBEDDED and message["usage"]["output_tokens"] <= 2
    assert fleet.record(raw_message.headers["request-id"])["attempts"] == _attempts(
        ("broken-2026", "broken-2026", "failed", "server_is_overloaded"),
        ("limited-2026", "limited-2026", "failed", "server_is_overloaded"),
        (EMBEDDED, EMBEDDED, "served", None))
    # "default": the fleet file's fallbacks.
    again = claude.beta.messages.create(model="limited-2026", max_tokens=3,
                                        messages=HELLO, fallbacks="default")
    assert again.model == EMBEDDED


def test_a_candidate_outside_the_keys_scope_is_skipped(fleet: Fleet) -> None:
    status, org = call(fleet.server, "POST", "/admin/v1/orgs", body={"name": "scoped"})
    assert status == 201, org
    status, key = call(fleet.server, "POST", "/admin/v1/keys", body={
        "org_id": org["id"], "models": ["limited-2026", "ok-2026"]})
    assert status == 201, key
    raw = fleet.openai(key["secret"]).chat.completions.with_raw_response.create(
        model="limited-2026", messages=HELLO, max_tokens=3,
        extra_body={"models": [EMBEDDED, "ok-2026"]})
    assert raw.parse().model == "ok-2026"
    request_id = raw.headers["x-request-id"]
    assert fleet.record(request_id, key["secret"])["attempts"] == _attempts(
        ("limited-2026", "limited-2026", "failed", "server_is_overloaded"),
        (EMBEDDED, EMBEDDED, "skipped", "model_not_in_scope"),
        ("ok-2026", "ok-2026", "served", None))
    assert [r["model"] for r in fleet.ledger(request_id)] == ["ok-2026"]


def test_no_first_byte_in_time_falls_back_unbilled(fleet: Fleet) -> None:
    began = time.monotonic()
    raw = fleet.openai().chat.completions.with_raw_response.create(
        model="silent-2026", messages=HELLO, max_tokens=3)
    assert raw.parse().model == "ok-2026"
    assert time.monotonic() - began < 10  # not the silent upstream's 30 s
    request_id = raw.headers["x-request-id"]
    assert fleet.record(request_id)["attempts"] == _attempts(
        ("silent-2026", "silent-2026", "failed", "timeout"),
        ("ok-2026", "ok-2026", "served", None))
    assert [r["model"] for r in fleet.ledger(request_id)] == ["ok-2026"]


def test_a_stream_never_switches_after_its_first_byte(fleet: Fleet) -> None:
    stream = fleet.openai().chat.completions.with_raw_response.create(
        model="cut-2026", messages=HELLO, max_tokens=6, stream=True)
    request_id = stream.headers["x-request-id"]
    models = []
    with pytest.raises(openai.APIError, match="cut-2026 failed while answering"):
        for chunk in stream.parse():
            models.append(chunk.model)
    assert models and set(models) == {"cut-2026"}
    record = fleet.record(request_id)
    assert record["attempts"] == _attempts(("cut-2026", "cut-2026", "served", None))
    assert record["deployment"] == "cut-2026" and record["error_code"] is not None
    assert all(r["model"] == "cut-2026" for r in fleet.ledger(request_id))


def test_an_upstream_429_goes_to_the_fallback_without_queueing(fleet: Fleet) -> None:
    began = time.monotonic()
    raw = fleet.openai().chat.completions.with_raw_response.create(
        model="limited-2026", messages=HELLO, max_tokens=3)
    assert raw.parse().model == EMBEDDED
    # Not after the balancer's queue timeout: the 429 sent the request on at once.
    assert time.monotonic() - began < QUEUE_TIMEOUT_S / 6
    assert fleet.record(raw.headers["x-request-id"])["attempts"] == _attempts(
        ("limited-2026", "limited-2026", "failed", "server_is_overloaded"),
        (EMBEDDED, EMBEDDED, "served", None))


def test_a_request_that_falls_back_counts_once_against_the_keys_rpm(fleet: Fleet) -> None:
    status, org = call(fleet.server, "POST", "/admin/v1/orgs", body={"name": "rpm-two"})
    assert status == 201, org
    status, key = call(fleet.server, "POST", "/admin/v1/keys", body={
        "org_id": org["id"], "rpm": 2, "tpm": 10_000})
    assert status == 201, key
    client = fleet.openai(key["secret"])
    raw = client.chat.completions.with_raw_response.create(
        model="limited-2026", messages=HELLO, max_tokens=3)
    reply = raw.parse()
    assert reply.model == EMBEDDED and reply.usage is not None
    assert len(fleet.record(raw.headers["x-request-id"], key["secret"])["attempts"]) == 2
    # Two attempts, one request; the tokens held are the attempt's that served.
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) == (
        10_000 - reply.usage.prompt_tokens - 3)
    again = client.chat.completions.with_raw_response.create(
        model="limited-2026", messages=HELLO, max_tokens=3)
    assert again.parse().model == EMBEDDED
    assert again.headers["x-ratelimit-remaining-requests"] == "0"
