"""Canary and shadow traffic, and the fleet's admin views, through a real `tokenyard serve
--config` (auth on: keys, billing and the ledger are real) in front of the project's mock
OpenAI servers as upstream deployments.

The mocks run in this process, on an event loop of their own in a thread, each behind a
middleware that counts the chat requests it received, so every share is counted where
the traffic lands. Which conversations an alias sends to its canary or copies to its
shadow follows from their first user message; the tests compute the same draw with
`gateway.routing` and compare it with what the mocks saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.e2e.conftest import Server, running_server
from tokenyard.bench.mock_core import MockConfig
from tokenyard.bench.mock_replica import MockReplica
from tokenyard.deployments import load_fleet
from tokenyard.gateway.routing import Router, conversation_key

PRIMARY, CANARY, SHADOW = "primary-2026-11-01", "canary-2026-11-20", "shadow-2026-11-22"
DUO = "duo-2026-11-01"
SHADOW_DELAY_MS = 3000.0  # the shadow mock's time to first token
PRIMARY_TOKENS, SHADOW_TOKENS = 8, 6  # different lengths: the texts differ
CHAT = "/v1/chat/completions"


class Mocks:
    """Mock OpenAI servers on one event loop in a thread; `counts[name]` is the number of
    chat requests each one received."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.counts: Counter[str] = Counter()
        self.runners: list[web.AppRunner] = []

    def start(self, name: str, **config: Any) -> str:
        """A mock named `name`; its OpenAI base URL."""
        app = MockReplica(MockConfig(**config)).make_app()

        @web.middleware
        async def count(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.path == CHAT:
                self.counts[name] += 1
            return await handler(request)  # type: ignore[no-any-return]

        app.middlewares.append(count)
        return self.serve(app)

    def serve(self, app: web.Application) -> str:
        """`app` served on 127.0.0.1 from the mocks' loop: its base URL + /v1."""
        async def go() -> str:
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runners.append(runner)
            return f"http://127.0.0.1:{runner.addresses[0][1]}/v1"

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)

    def close(self) -> None:
        async def go() -> None:
            for runner in self.runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def fleet_toml(urls: dict[str, str]) -> str:
    def deployment(name: str, *mocks: str) -> str:
        listed = ", ".join(f'"{urls[m]}"' for m in mocks)
        return (f'[[deployments]]\nname = "{name}"\nkind = "upstream"\nmodel = "mock"\n'
                f'urls = [{listed}]\nprices = {{ input = "1.00", output = "2.00" }}\n\n')

    return (
        '[balancer]\npolicy = "round_robin"\nhealth_interval_s = 0.5\n\n'
        + deployment(PRIMARY, "primary") + deployment(CANARY, "canary")
        + deployment(SHADOW, "shadow") + deployment(DUO, "duo1", "duo2")
        + "[aliases.chat]\n"
        f'route = {{ "{PRIMARY}" = 90, "{CANARY}" = 10 }}\n'
        "[aliases.mirrored]\n"
        f'route = {{ "{PRIMARY}" = 1 }}\n'
        f'shadow = {{ deployment = "{SHADOW}", share = 0.5 }}\n'
        "[aliases.echo]\n"
        f'route = {{ "{PRIMARY}" = 1 }}\n'
        f'shadow = {{ deployment = "{CANARY}", share = 1.0 }}\n'
    )


class Fleet:
    def __init__(self, server: Server, mocks: Mocks, router: Router, state_dir: str) -> None:
        self.server, self.mocks, self.router, self.state_dir = server, mocks, router, state_dir


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    mocks = Mocks()
    try:
        plain = {"output_len": PRIMARY_TOKENS, "itl_ms": 0.0}
        urls = {name: mocks.start(name, **plain)
                for name in ("primary", "canary", "duo1", "duo2")}
        urls["shadow"] = mocks.start("shadow", output_len=SHADOW_TOKENS, itl_ms=0.0,
                                     ttft_ms=SHADOW_DELAY_MS)
        with tempfile.TemporaryDirectory(prefix="tokenyard-fleet-") as state:
            path = Path(state) / "fleet.toml"
            path.write_text(fleet_toml(urls))
            router = Router(load_fleet(path))
            # The edge's per-address bucket (500 a second) off: the module's hundreds of
            # chats come from one address, and on a fast machine the mocks answer them
            # faster than that (a Zen 5 got 429s); the edge has tests of its own.
            with running_server("--config", str(path), state_dir=state,
                                env={"TOKENYARD_EDGE_REQUESTS_PER_S": "0"}) as (server, _):
                yield Fleet(server, mocks, router, state)
    finally:
        mocks.close()


def chat_body(model: str, first: str, *later: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": first}]
    for text in later:
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text}]
    return {"model": model, "messages": messages, "max_tokens": 16}


async def chats(server: Server, bodies: list[dict[str, Any]], concurrency: int = 32,
                headers: dict[str, str] | None = None) -> list[tuple[dict[str, Any], float]]:
    """Each body's answer and its latency (s), `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(headers=headers or server.headers) as session:
        async def one(body: dict[str, Any]) -> tuple[dict[str, Any], float]:
            async with gate:
                began = time.perf_counter()
                async with session.post(server.base_url + CHAT, json=body) as r:
                    answer = await r.json()
                    assert r.status == 200, answer
                return answer, time.perf_counter() - began

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def run_chats(server: Server, bodies: list[dict[str, Any]], concurrency: int = 32,
              headers: dict[str, str] | None = None) -> list[tuple[dict[str, Any], float]]:
    return asyncio.run(chats(server, bodies, concurrency, headers))


async def admin_call(server: Server, method: str, path: str, body: Any = None,
                     headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.request(
            method, server.base_url + path, json=body,
            headers=server.headers if headers is None else headers) as r:
        return r.status, await r.json(content_type=None)


def admin(server: Server, method: str, path: str, body: Any = None,
          headers: dict[str, str] | None = None) -> tuple[int, Any]:
    return asyncio.run(admin_call(server, method, path, body, headers))


def wait_for(check: Callable[[], Any], timeout: float = 15.0) -> Any:
    """Poll `check` until it returns something truthy (the ledger and the shadow results
    are written in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def usage_by_model(server: Server, org_id: str) -> dict[str, int]:
    status, body = admin(server, "GET", f"/admin/v1/usage?group_by=model&org_id={org_id}")
    assert status == 200, body
    return {row["group"]: row["requests"] for row in body["data"]}


def new_key(server: Server, name: str) -> tuple[str, dict[str, str]]:
    """A new org and a key of it: (org id, its bearer header)."""
    status, org = admin(server, "POST", "/admin/v1/orgs", {"name": name})
    assert status == 201, org
    status, key = admin(server, "POST", "/admin/v1/keys", {"org_id": org["id"]})
    assert status == 201, key
    return org["id"], {"Authorization": f"Bearer {key['secret']}"}


# ---------------------------------------------------------------------------- canary


def test_canary_takes_its_weight_and_a_conversation_sticks_to_one_deployment(
        fleet: Fleet) -> None:
    before = Counter(fleet.mocks.counts)
    firsts = [f"canary conversation {i}: tell me about the number {i * 7919}"
              for i in range(1000)]
    answers = run_chats(fleet.server, [chat_body("chat", f) for f in firsts])
    used = [answer["model"] for answer, _ in answers]
    assert set(used) == {PRIMARY, CANARY}
    share = used.count(CANARY) / len(used)
    assert 0.07 <= share <= 0.13, share
    # Counted where the traffic landed, too.
    landed = fleet.mocks.counts - before
    assert (landed["canary"], landed["primary"]) == (used.count(CANARY), used.count(PRIMARY))
    # The draw is the routing's own: the same first message, the same deployment.
    expected = [fleet.router.resolve("chat", conversation_key(f)).deployment for f in firsts]
    assert used == expected

    # Later turns of the same conversations: never another deployment than the first's.
    picked = list(range(0, 1000, 10))
    later = run_chats(fleet.server, [
        chat_body("chat", firsts[i], f"and then {j}?") for i in picked for j in range(2)])
    assert [answer["model"] for answer, _ in later] == [used[i] for i in picked for _ in "ab"]


# ---------------------------------------------------------------------------- shadow


def test_shadow_copies_its_share_unbilled_without_delaying_the_caller(fleet: Fleet) -> None:
    server, mocks = fleet.server, fleet.mocks
    org_id, headers = new_key(server, "shadowed")
    before = Counter(mocks.counts)
    firsts = [f"shadowed conversation {i}" for i in range(200)]
    shadowed = [f for f in firsts
                if fleet.router.resolve("mirrored", conversation_key(f)).shadow == SHADOW]
    assert 70 <= len(shadowed) <= 130  # a share of 0.5

    answers = run_chats(server, [chat_body("mirrored", f) for f in firsts], concurrency=16,
                        headers=headers)
    assert {a["model"] for a, _ in answers} == {PRIMARY}
    latency = {f: seconds for f, (_, seconds) in zip(firsts, answers, strict=True)}
    # The caller never waits for the copy: every shadowed request was answered well
    # before the shadow could even have produced its first token.
    assert max(latency[f] for f in shadowed) < SHADOW_DELAY_MS / 1e3 * 0.6
    plain = [latency[f] for f in firsts if f not in shadowed]
    assert statistics.median(latency[f] for f in shadowed) < statistics.median(plain) + 0.25

    # Exactly the drawn conversations reached the shadow, once each.
    landed = wait_for(lambda: (c := mocks.counts - before)["shadow"] >= len(shadowed) and c)
    assert (landed["shadow"], landed["primary"]) == (len(shadowed), len(firsts))

    # The ledger: one row per caller request, none for the copies.
    ledger = wait_for(lambda: (u := usage_by_model(server, org_id)).get(PRIMARY, 0) >= 200 and u)
    time.sleep(1.0)  # and nothing more arrives once the copies are done
    assert usage_by_model(server, org_id) == ledger == {PRIMARY: len(firsts)}

    # The comparison, over HTTP and from the CLI: different lengths, so no text matches.
    def report() -> list[dict[str, Any]] | None:
        status, body = admin(server, "GET", "/admin/v1/shadow/report?alias=mirrored")
        assert status == 200, body
        rows: list[dict[str, Any]] = body["data"]
        return rows if rows and rows[0]["count"] >= len(shadowed) else None

    rows = wait_for(report)
    assert rows is not None and len(rows) == 1
    row = rows[0]
    assert (row["alias"], row["primary"], row["shadow"], row["count"]) == (
        "mirrored", PRIMARY, SHADOW, len(shadowed))
    assert row["match_rate"] == 0.0
    assert (row["primary_mean_output_tokens"], row["shadow_mean_output_tokens"]) == (
        PRIMARY_TOKENS, SHADOW_TOKENS)
    assert row["shadow_p50_ms"] >= SHADOW_DELAY_MS > row["primary_p50_ms"]
    assert row["latency_ratio"] == pytest.approx(row["shadow_p50_ms"] / row["primary_p50_ms"])

    cli = subprocess.run(
        [sys.executable, "-m", "tokenyard.cli", "admin", "shadow", "report",
         "--alias", "mirrored", "--format", "json"],
        capture_output=True, text=True, timeout=60,
        env={**_env(), "TOKENYARD_STATE_DIR": fleet.state_dir})
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == rows


def test_shadow_with_the_same_answer_matches(fleet: Fleet) -> None:
    firsts = [f"echoed conversation {i}" for i in range(20)]
    for stream in (False, True):
        bodies = [{**chat_body("echo", f), "stream": stream} for f in firsts]
        if stream:
            asyncio.run(_streamed(fleet.server, bodies))
        else:
            run_chats(fleet.server, bodies)

    def report() -> list[dict[str, Any]] | None:
        _, body = admin(fleet.server, "GET", "/admin/v1/shadow/report?alias=echo")
        rows: list[dict[str, Any]] = body["data"]
        return rows if rows and rows[0]["count"] >= 40 else None

    rows = wait_for(report)
    assert rows is not None
    assert [(r["primary"], r["shadow"], r["count"], r["match_rate"]) for r in rows] == [
        (PRIMARY, CANARY, 40, 1.0)]


async def _streamed(server: Server, bodies: list[dict[str, Any]]) -> None:
    async with aiohttp.ClientSession(headers=server.headers) as session:
        for body in bodies:
            async with session.post(server.base_url + CHAT, json=body) as r:
                assert r.status == 200
                assert (await r.read()).endswith(b"data: [DONE]\n\n")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TOKENYARD_DATABASE_URL"}
    return {**env, "PYTHONUNBUFFERED": "1"}


# ---------------------------------------------------------------------------- admin views


def test_deployments_view_and_drain(fleet: Fleet) -> None:
    server, mocks = fleet.server, fleet.mocks
    assert admin(server, "GET", "/admin/v1/deployments", headers={})[0] == 401

    status, body = admin(server, "GET", "/admin/v1/deployments")
    assert status == 200, body
    by_name = {d["name"]: d for d in body["data"]}
    assert set(by_name) == {PRIMARY, CANARY, SHADOW, DUO}
    duo = by_name[DUO]
    assert (duo["kind"], duo["capabilities"], duo["prices"]) == (
        "upstream", ["chat", "completions"],
        {"input": "1.00", "cached_input": "0.00", "output": "2.00"})
    duo1, duo2 = (r["id"] for r in duo["replicas"])
    assert [r["state"] for r in duo["replicas"]] == ["healthy", "healthy"]
    aliases = {a["name"]: a for a in body["aliases"]}
    assert aliases["chat"]["routes"] == {PRIMARY: 90, CANARY: 10}
    assert aliases["mirrored"]["shadow"] == {"deployment": SHADOW, "share": 0.5}

    status, err = admin(server, "POST", "/admin/v1/replicas/drain",
                        {"deployment": DUO, "replica": "http://nowhere/v1"})
    assert status == 400 and err["error"]["param"] == "replica"
    status, drained = admin(server, "POST", "/admin/v1/replicas/drain",
                            {"deployment": DUO, "replica": duo1, "drain": True})
    assert status == 200 and drained["state"] == "draining"

    before = Counter(mocks.counts)
    run_chats(server, [chat_body(DUO, f"drained {i}") for i in range(20)], concurrency=4)
    landed = mocks.counts - before
    assert (landed["duo1"], landed["duo2"]) == (0, 20)

    # Undrained from the command line, which asks the running server.
    cli = subprocess.run(
        [sys.executable, "-m", "tokenyard.cli", "admin", "replicas", "drain", "--deployment",
         DUO, "--replica", duo1, "--undo", "--url", server.base_url,
         "--api-key", server.api_key or "", "--format", "json"],
        capture_output=True, text=True, timeout=60, env=_env())
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["state"] == "healthy"
    before = Counter(mocks.counts)
    run_chats(server, [chat_body(DUO, f"undrained {i}") for i in range(20)], concurrency=4)
    landed = mocks.counts - before
    assert landed["duo1"] >= 5 and landed["duo2"] >= 5 and landed.total() == 20

    cli = subprocess.run(
        [sys.executable, "-m", "tokenyard.cli", "admin", "deployments", "--url",
         server.base_url, "--api-key", server.api_key or ""],
        capture_output=True, text=True, timeout=60, env=_env())
    assert cli.returncode == 0, cli.stderr
    assert duo2 in cli.stdout and f"shadow {SHADOW} 0.5" in cli.stdout
