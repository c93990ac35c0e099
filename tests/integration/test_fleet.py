"""The fleet over real engines: two `tokenyard engine --threads 1` processes started here
(so one can be SIGKILLed and started again on its port) behind `tokenyard serve --config`
listing their URLs, with the gateway on (keys, the ledger).

- Prefix affinity: every later turn of a conversation lands on the replica that served
  its first (the pool's own counts, `GET /admin/v1/deployments`), and the cached prompt
  tokens are at least twice round robin's on the same workload shape.
- `kill -9` of a replica under streaming load: requests not yet streaming all succeed,
  streams on the dead replica end with an error event, the replica is out within 2 s and
  back after its restart; the ledger has one row per request that produced tokens.
- SIGHUP while streaming: nothing in flight fails, a new alias resolves, a removed
  deployment answers 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.conftest import Server, running_server

pytestmark = pytest.mark.slow

DEPLOYMENT = "smol-2026-11-22"
SOLO = "smol-solo-2026-11-22"  # a second deployment on the first replica only
_READY = re.compile(r"serving at (http://\S+)")


@dataclass
class Engine:
    """One `tokenyard engine` process this module started."""

    token: str
    port: int = 0
    proc: subprocess.Popen[str] | None = None
    url: str = ""
    env: dict[str, str] = field(default_factory=dict)  # beyond this process's own

    def start(self) -> None:
        env = {**os.environ, "TOKENYARD_REPLICA_TOKEN": self.token, "PYTHONUNBUFFERED": "1",
               **self.env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenyard.cli", "engine", "--host", "127.0.0.1",
             "--port", str(self.port), "--threads", "1", "--drain-timeout", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if m := _READY.search(line):
                self.url = m.group(1)
                self.port = int(self.url.rsplit(":", 1)[1])
                return
        pytest.fail(f"the engine exited with {self.proc.wait()} before serving")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Fleet:
    server: Server
    proc: subprocess.Popen[str]
    engines: list[Engine]
    config: Path
    state: Path


def fleet_toml(engines: list[Engine], policy: str, *, solo: bool = True,
               aliases: dict[str, str] | None = None) -> str:
    urls = ", ".join(f'"{e.url}"' for e in engines)
    text = (f'[balancer]\npolicy = "{policy}"\nhealth_interval_s = 0.5\n'
            f'eject_after = 2\neject_base_s = 1.0\n\n'
            f'[[deployments]]\nname = "{DEPLOYMENT}"\nurls = [{urls}]\n\n')
    if solo:
        text += f'[[deployments]]\nname = "{SOLO}"\nurls = ["{engines[0].url}"]\n\n'
    text += "[aliases]\n" + "".join(f'{a} = "{d}"\n' for a, d in (aliases or {}).items())
    return text


@pytest.fixture(scope="module")
def engines() -> Iterator[list[Engine]]:
    token = secrets.token_urlsafe(16)
    started = [Engine(token), Engine(token)]
    try:
        for engine in started:
            engine.start()
        yield started
    finally:
        for engine in started:
            engine.stop()


@contextlib.contextmanager
def serve_fleet(engines: list[Engine], directory: Path, policy: str,
                *extra: str) -> Iterator[Fleet]:
    config = directory / "tokenyard.toml"
    config.write_text(fleet_toml(engines, policy, aliases={"smol": DEPLOYMENT}))
    state = directory / "state"
    state.mkdir()
    with running_server("--config", str(config), *extra, state_dir=str(state),
                        env={"TOKENYARD_REPLICA_TOKEN": engines[0].token}) as (server, proc):
        yield Fleet(server, proc, engines, config, state)


@pytest.fixture(scope="module")
def fleet(engines: list[Engine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with serve_fleet(engines, tmp_path_factory.mktemp("fleet"), "affinity") as f:
        yield f


async def replicas(session: aiohttp.ClientSession, fleet: Fleet,
                   name: str = DEPLOYMENT) -> dict[str, dict[str, Any]]:
    """The pool's view of each replica of deployment `name` (admin route)."""
    async with session.get(f"{fleet.server.base_url}/admin/v1/deployments",
                           headers=fleet.server.headers) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    dep = next(d for d in body["data"] if d["name"] == name)
    return {r["id"]: r for r in dep["replicas"]}


async def chat(session: aiohttp.ClientSession, server: Server, messages: list[dict[str, str]],
               model: str = DEPLOYMENT, max_tokens: int = 8) -> tuple[int, dict[str, Any]]:
    async with session.post(
        f"{server.base_url}/v1/chat/completions", headers=server.headers,
        json={"model": model, "messages": messages, "max_tokens": max_tokens,
              "temperature": 0},
    ) as resp:
        return resp.status, await resp.json()


@dataclass
class StreamResult:
    request_id: str = ""
    status: int = 0
    content_chunks: int = 0
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    started: asyncio.Event = field(default_factory=asyncio.Event)


async def stream(session: aiohttp.ClientSession, server: Server, text: str,
                 model: str = DEPLOYMENT, max_tokens: int = 32,
                 out: StreamResult | None = None, system: str | None = None) -> StreamResult:
    """A streamed chat request, read to its end; `out` is filled as it goes. `system`:
    a system message (else the template's default one, which every request shares)."""
    out = out if out is not None else StreamResult()
    messages = [{"role": "user", "content": text}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    async with session.post(
        f"{server.base_url}/v1/chat/completions", headers=server.headers,
        json={"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
              "ignore_eos": True, "messages": messages},
    ) as resp:
        out.status, out.request_id = resp.status, resp.headers.get("x-request-id", "")
        if resp.status != 200:
            out.error = (await resp.json()).get("error")
            return out
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]
                continue
            for choice in event.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    out.content_chunks += 1
                    out.started.set()
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
    return out


def conversation_turns(topic: str, turns: int) -> list[list[dict[str, str]]]:
    """Each turn's messages: every user turn adds a long paragraph (the prefix grows)."""
    messages: list[dict[str, str]] = [{"role": "system", "content": f"You help with {topic}."}]
    out = []
    for t in range(turns):
        paragraph = " ".join(f"{topic} note {t}.{i}: the {topic} item number {i} matters."
                             for i in range(12))
        messages = [*messages, {"role": "user", "content": paragraph}]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"Noted {topic} {t}."}]
    return out


async def run_conversations(server: Server, topics: list[str], turns: int,
                            fleet: Fleet | None = None) -> tuple[int, list[list[str]]]:
    """Conversation after conversation, turn after turn (one request at a time): the
    cached prompt tokens in all, and (given the fleet's admin view) which replica served
    each turn."""
    cached = 0
    placement: list[list[str]] = []
    async with aiohttp.ClientSession() as session:
        for topic in topics:
            placement.append([])
            for messages in conversation_turns(topic, turns):
                before = await replicas(session, fleet) if fleet else {}
                status, body = await chat(session, server, messages)
                assert status == 200, body
                cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
                if fleet:
                    after = await replicas(session, fleet)
                    served = [r for r in after if after[r]["served"] > before[r]["served"]]
                    assert len(served) == 1, (before, after)
                    placement[-1].append(served[0])
    return cached, placement


# Shorter: tests/unit/test_balancer_policy.py and test_pool.py route by prefix affinity.
@pytest.mark.long
def test_affinity_keeps_conversations_on_their_replica(
    fleet: Fleet, engines: list[Engine], tmp_path: Path
) -> None:
    turns = 3
    cached, placement = asyncio.run(run_conversations(
        fleet.server, ["astronomy", "botany", "cooking", "dentistry"], turns, fleet))
    for conv in placement:
        assert conv == [conv[0]] * turns, placement  # turns 2..k follow turn 1
    # Round robin over the same replicas, the same workload shape, fresh texts (the
    # affinity run's prefixes are cached on the engines): later turns alternate.
    with serve_fleet(engines, tmp_path, "round_robin", "--no-auth") as rr:
        rr_cached, _ = asyncio.run(run_conversations(
            rr.server, ["geology", "history", "icebergs", "jazz"], turns))
    assert cached >= 2 * rr_cached > 0, (cached, rr_cached)


def test_kill_9_of_a_replica_under_streaming_load(fleet: Fleet) -> None:
    victim = fleet.engines[1]
    before = _ledger(fleet.state)

    async def scenario() -> list[StreamResult]:
        async with aiohttp.ClientSession() as session:
            texts = [f"Write a long story about the number {i}." for i in range(8)]
            results = [StreamResult() for _ in texts]
            running = [asyncio.create_task(stream(session, fleet.server, t, out=r))
                       for t, r in zip(texts, results, strict=True)]
            # Not racing the first byte: kill once every stream has started.
            await asyncio.wait_for(asyncio.gather(*(r.started.wait() for r in results)), 120)
            on_victim = (await replicas(session, fleet))[victim.url]["inflight"]
            assert on_victim > 0  # the load is spread: some streams run on the victim
            killed_at = time.monotonic()
            victim.kill()
            # Requests that had not started streaming: all of them succeed (failover).
            fresh = [asyncio.create_task(stream(session, fleet.server, f"Say {i}."))
                     for i in range(8)]
            # The dead replica is out of the pool within 2 s.
            while (await replicas(session, fleet))[victim.url]["state"] == "healthy":
                assert time.monotonic() - killed_at < 2.0, "not marked down in 2 s"
                await asyncio.sleep(0.05)
            old = await asyncio.wait_for(asyncio.gather(*running), 60)
            new = await asyncio.wait_for(asyncio.gather(*fresh), 120)
            for r in new:
                assert (r.status, r.error, r.finish_reason) == (200, None, "length"), r
            broken = [r for r in old if r.error is not None]
            assert len(broken) == on_victim, old  # each ended with an error event, no hang
            assert all(r.finish_reason == "length" for r in old if r.error is None)
            # Restarted on its port: re-admitted, and requests reach it again.
            victim.start()
            deadline = time.monotonic() + 30
            served_before = (await replicas(session, fleet))[victim.url]["served"]
            while (await replicas(session, fleet))[victim.url]["served"] == served_before:
                assert time.monotonic() < deadline, json.dumps(await replicas(session, fleet))
                # Prefixes nobody holds (no affinity): the least loaded replica wins.
                batch = [stream(session, fleet.server, "Again.", max_tokens=4,
                                system=f"{secrets.token_hex(8)} is your name.")
                         for _ in range(4)]
                again = await asyncio.gather(*batch)
                assert all(r.error is None for r in again)
                new.extend(again)
                await asyncio.sleep(0.2)
            assert (await replicas(session, fleet))[victim.url]["state"] == "healthy"
            return [*old, *new]

    results = asyncio.run(scenario())
    # The ledger: one row per request that produced tokens, none lost, none doubled (its
    # request ids are the gateway's own, so count the rows this test added, by outcome).
    produced = [r for r in results if r.content_chunks]
    assert len(produced) == len(results)
    expected = {"completed": sum(r.error is None for r in produced)}
    if len(produced) > expected["completed"]:
        expected["failed"] = len(produced) - expected["completed"]
    deadline = time.monotonic() + 20
    while (added := _added(before, _ledger(fleet.state))) != expected:
        assert time.monotonic() < deadline, (added, expected)
        time.sleep(0.2)
    time.sleep(1.0)
    assert _added(before, _ledger(fleet.state)) == expected  # nothing settled twice, late


def _ledger(state: Path) -> dict[str, tuple[str, int]]:
    """request id → (status, output tokens) of every ledger row."""
    with sqlite3.connect(state / "tokenyard.db") as db:
        return {rid: (status, out) for rid, status, out in db.execute(
            "SELECT request_id, status, output_tokens FROM usage_ledger")}


def _added(before: dict[str, tuple[str, int]],
           after: dict[str, tuple[str, int]]) -> dict[str, int]:
    """Rows added since `before`, counted by status (each with output tokens)."""
    counts: dict[str, int] = {}
    for rid, (status, out) in after.items():
        if rid not in before:
            assert out > 0, (rid, status)
            counts[status] = counts.get(status, 0) + 1
    return counts


def test_sighup_reload_while_streaming(fleet: Fleet) -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            status, _ = await chat(session, fleet.server, [{"role": "user", "content": "Hi"}],
                                   model=SOLO)
            assert status == 200
            running = [asyncio.create_task(stream(session, fleet.server, f"Tell tale {i}.",
                                                  max_tokens=48)) for i in range(6)]
            await asyncio.sleep(0.5)
            fleet.config.write_text(fleet_toml(
                fleet.engines, "affinity", solo=False,
                aliases={"smol": DEPLOYMENT, "smol-latest": DEPLOYMENT}))
            fleet.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            while True:
                status, body = await chat(session, fleet.server,
                                          [{"role": "user", "content": "Hi"}],
                                          model="smol-latest", max_tokens=2)
                if status == 200:
                    break
                assert status == 404 and time.monotonic() < deadline, body
                await asyncio.sleep(0.2)
            assert body["model"] == DEPLOYMENT  # the response names the deployment used
            status, body = await chat(session, fleet.server,
                                      [{"role": "user", "content": "Hi"}], model=SOLO)
            assert status == 404, body
            assert body["error"]["code"] == "model_not_found", body
            for r in await asyncio.wait_for(asyncio.gather(*running), 120):
                assert (r.status, r.error, r.finish_reason, r.done) == (
                    200, None, "length", True), r

    asyncio.run(scenario())
