"""Upstream deployments are someone else's servers: what `tokenyard serve` sends them and
what of theirs it shows a tenant, checked over HTTP.

A fleet file names upstream deployments on the project's mock OpenAI server (run in this
process, on a thread of its own, so the test reads what each one received) and on a
canned server whose stream breaks off. Two orgs, made through the admin API, call them:

- no upstream is sent the replica token: one without `token_env` gets no Authorization
  header at all (health checks included), one with it gets its own key;
- an upstream that keeps one prefix cache for everyone (`server` left at "openai") shows
  no tenant another's cache: org B's first request reports 0 cached tokens and is billed
  as uncached input, though the upstream hit org A's prompt;
- a vLLM upstream is sent each org's own `cache_salt`, never the org's id;
- an upstream's failures reach the tenant without its address or its error texts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from tests.e2e.conftest import Server, running_server
from tokenyard.bench.mock_core import MockConfig
from tokenyard.bench.mock_openai import PREFIX_BLOCK
from tokenyard.bench.mock_replica import MockReplica

PLAIN = "plain-upstream-2026-12-01"  # server = "openai" (the default), no token_env
KEYED = "keyed-upstream-2026-12-01"  # token_env: its own key
SALTED = "vllm-upstream-2026-12-01"  # server = "vllm"
BUSY = "busy-upstream-2026-12-01"  # answers 429 with its own text
FAILING = "failing-upstream-2026-12-01"  # an error event after the first chunk
CUT = "cut-upstream-2026-12-01"  # its stream breaks off unfinished
UPSTREAM_KEY = "upstream-key-of-keyed"
#: A long prompt (the mock counts words): many blocks of the mock's prefix cache.
LONG = " ".join(f"word{i}" for i in range(400))
PROMPT_WORDS = 401  # a word to tell the tests' prompts apart, then LONG
#: What a second request of the prompt finds cached, block by block (never its last word).
CACHED_AGAIN = (PROMPT_WORDS - 1) // PREFIX_BLOCK * PREFIX_BLOCK


@dataclass
class Fleet:
    server: Server
    mocks: dict[str, MockReplica]
    #: Each upstream's host:port, which no tenant may see.
    addresses: list[str]
    keys: dict[str, str]  # org name → its key's secret
    orgs: dict[str, str]  # org name → its id


async def _canned_cut(request: web.Request) -> web.StreamResponse:
    """A chat stream that sends two chunks and ends without finishing."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for text in ("Hel", "lo"):
        chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    return response


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "cut", "object": "model"}]})


def _cut_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _canned_cut)
    app.router.add_get("/v1/models", _models)
    return app


@contextlib.contextmanager
def _serving(apps: dict[str, web.Application]) -> Iterator[dict[str, str]]:
    """`apps` on free ports of an event loop on its own thread; their base URLs."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    try:
        yield {name: asyncio.run_coroutine_threadsafe(start(app), loop).result(10)
               for name, app in apps.items()}
    finally:
        for runner in runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _admin(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.base_url + path, json=body, headers=server.headers, timeout=30)
    assert r.status_code == 201, r.text
    found: dict[str, Any] = r.json()
    return found


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    quick: dict[str, Any] = {"output_len": 3, "itl_ms": 0.0}
    mocks = {PLAIN: MockReplica(MockConfig(**quick)), KEYED: MockReplica(MockConfig(**quick)),
             SALTED: MockReplica(MockConfig(**quick)),
             BUSY: MockReplica(MockConfig(**quick, inject_429=1.0)),
             FAILING: MockReplica(MockConfig(output_len=8, itl_ms=0.0,
                                             inject_stream_error=1.0))}
    apps = {name: mock.make_app() for name, mock in mocks.items()} | {CUT: _cut_app()}
    with _serving(apps) as urls, tempfile.TemporaryDirectory() as tmp:
        servers = {PLAIN: "", KEYED: 'token_env = "KEYED_UPSTREAM_KEY"\n',
                   SALTED: 'server = "vllm"\n', BUSY: "", FAILING: "", CUT: ""}
        config = Path(tmp) / "tokenyard.toml"
        config.write_text("""
[balancer]
queue_timeout_s = 0
eject_after = 1000
""" + "".join(f"""
[[deployments]]
name = "{name}"
kind = "upstream"
urls = ["{urls[name]}/v1"]
model = "mock"
prices = {{ input = "1", cached_input = "0", output = "0" }}
{extra}""" for name, extra in servers.items()))
        with running_server("--config", str(config),
                            env={"KEYED_UPSTREAM_KEY": UPSTREAM_KEY}) as (server, _):
            orgs = {name: _admin(server, "/admin/v1/orgs", {"name": name})["id"]
                    for name in ("org-a", "org-b")}
            keys = {name: _admin(server, "/admin/v1/keys", {"org_id": org})["secret"]
                    for name, org in orgs.items()}
            yield Fleet(server, mocks, [u.removeprefix("http://") for u in urls.values()],
                        keys, orgs)


def _chat(fleet: Fleet, org: str, model: str, content: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        fleet.server.base_url + "/v1/chat/completions", timeout=30,
        headers={"Authorization": f"Bearer {fleet.keys[org]}"},
        json={"model": model, "messages": [{"role": "user", "content": content}],
              "max_tokens": 3, **extra})


def _cached(reply: httpx.Response) -> int:
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _last_body(mock: MockReplica) -> dict[str, Any]:
    """The body of the last request `mock` received."""
    body = mock.received[-1].body
    assert body is not None
    return body


def _org_cost(fleet: Fleet, org: str, requests: int) -> Decimal:
    """The org's billed total once its `requests` ledger rows landed (off the path)."""
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(fleet.server.base_url + "/admin/v1/usage", timeout=30,
                      params={"group_by": "org", "org_id": fleet.orgs[org]},
                      headers=fleet.server.headers)
        rows = r.json()["data"]
        if rows and rows[0]["requests"] >= requests:
            assert rows[0]["requests"] == requests
            return Decimal(str(rows[0]["cost"]))
        assert time.monotonic() < deadline, f"no ledger rows for {org}: {rows}"
        time.sleep(0.05)


def test_no_upstream_is_sent_the_replica_token(fleet: Fleet) -> None:
    """The replica token opens our replicas to any tenant's requests: an upstream's
    operator must never see it. Health checks and requests alike carry the upstream's
    own key, or none."""
    for model in (PLAIN, KEYED):
        assert _chat(fleet, "org-a", model, "Hello there").status_code == 200
    replica_token = fleet.server.replica_token
    assert replica_token
    plain, keyed = fleet.mocks[PLAIN].received, fleet.mocks[KEYED].received
    for name, received in ((PLAIN, plain), (KEYED, keyed)):
        deadline = time.monotonic() + 10  # the health checks run every second
        while "/v1/models" not in {seen.path for seen in received}:
            assert time.monotonic() < deadline, f"no health check reached {name}"
            time.sleep(0.1)
        paths = {seen.path for seen in received}
        assert {"/v1/models", "/v1/chat/completions"} <= paths, (name, paths)
        assert all(replica_token not in (seen.authorization or "") for seen in received)
    assert {seen.authorization for seen in plain} == {None}
    assert {seen.authorization for seen in keyed} == {f"Bearer {UPSTREAM_KEY}"}


def test_an_upstream_without_salts_never_shows_another_orgs_cache(fleet: Fleet) -> None:
    """The upstream keeps one cache for all: org B's copy of org A's long prompt hits
    there, but org B is shown 0 cached tokens and billed every prompt token as input."""
    prompt = "plain " + LONG
    assert _cached(_chat(fleet, "org-a", PLAIN, prompt)) == 0
    b = _chat(fleet, "org-b", PLAIN, prompt)
    assert _cached(b) == 0
    assert b.json()["usage"]["prompt_tokens"] == PROMPT_WORDS
    # The upstream did serve it from its cache: no salt was sent to keep them apart.
    assert "cache_salt" not in _last_body(fleet.mocks[PLAIN])
    message = httpx.post(
        fleet.server.base_url + "/v1/messages", timeout=30,
        headers={"x-api-key": fleet.keys["org-b"], "anthropic-version": "2023-06-01"},
        json={"model": PLAIN, "max_tokens": 3,
              "messages": [{"role": "user", "content": prompt}]})
    assert message.status_code == 200, message.text
    usage = message.json()["usage"]
    assert not usage.get("cache_read_input_tokens") and usage["input_tokens"] == PROMPT_WORDS
    # Billed at the input price (1 per million) for every prompt token, twice; what the
    # upstream reported as cached would have cost 0.
    assert _org_cost(fleet, "org-b", 2) == Decimal(2 * PROMPT_WORDS) / 1_000_000


def test_a_vllm_upstream_gets_each_orgs_own_salt(fleet: Fleet) -> None:
    """vLLM keeps a prefix cache per `cache_salt`: each org is sent its own, so org B's
    copy of org A's prompt misses, while org A's second request hits its own blocks."""
    prompt = "salted " + LONG
    mock = fleet.mocks[SALTED]
    assert _cached(_chat(fleet, "org-a", SALTED, prompt)) == 0
    salt_a = _last_body(mock)["cache_salt"]
    assert _cached(_chat(fleet, "org-b", SALTED, prompt)) == 0
    salt_b = _last_body(mock)["cache_salt"]
    assert isinstance(salt_a, str) and isinstance(salt_b, str) and salt_a != salt_b
    # A digest: the upstream does not learn our orgs' ids.
    assert fleet.orgs["org-a"] not in salt_a and fleet.orgs["org-b"] not in salt_b
    assert _cached(_chat(fleet, "org-a", SALTED, prompt)) == CACHED_AGAIN
    assert _last_body(mock)["cache_salt"] == salt_a


def _no_internals(fleet: Fleet, text: str) -> None:
    """`text` (what a tenant got) names no upstream address and no upstream's or
    exception's text."""
    for address in fleet.addresses:
        assert address not in text, text
    for leak in ("127.0.0.1", "http://", "injected failure", "Error(", "ValueError"):
        assert leak not in text, text


def test_an_overloaded_upstreams_refusal_shows_none_of_its_text(fleet: Fleet) -> None:
    """A guard more than a regression test: the balancer's queue words the refusal of a
    deployment whose every member is full, so the upstream's 429 text stayed out before
    too; the client's own error no longer carries it either."""
    busy = _chat(fleet, "org-a", BUSY, "Hi")
    assert busy.status_code == 503 and busy.headers["retry-after"]
    _no_internals(fleet, busy.text)


@pytest.mark.parametrize("model", [FAILING, CUT])
def test_an_upstream_failure_mid_stream_names_the_deployment_not_its_internals(
        fleet: Fleet, model: str) -> None:
    """An error event from the upstream (its own text), or a stream that breaks off (the
    exception, the URL): the tenant's error event says which deployment failed."""
    with httpx.stream(
        "POST", fleet.server.base_url + "/v1/chat/completions", timeout=30,
        headers={"Authorization": f"Bearer {fleet.keys['org-a']}"},
        json={"model": model, "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 8, "stream": True},
    ) as r:
        assert r.status_code == 200
        body = r.read().decode()
    _no_internals(fleet, body)
    events = [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: {")]
    error = events[-1]["error"]
    assert model in error["message"], error
