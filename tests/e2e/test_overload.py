"""Overload and a replica that dies mid-stream, against the real engine.

A replica of its own, started as `tokenyard engine` with one running slot and one waiting
slot, behind `tokenyard serve --replica-url`: the shape of a remote replica (both ends
given one TOKENYARD_REPLICA_TOKEN), and the only way to kill the engine without taking the
HTTP process down with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.e2e.conftest import START_TIMEOUT_S, Server, running_server

pytestmark = pytest.mark.slow

_ENGINE = re.compile(r"tokenyard engine: \S+ serving at (http://\S+)")


@pytest.fixture(scope="module")
def small_replica() -> Iterator[tuple[Server, subprocess.Popen[str]]]:
    cmd = [sys.executable, "-m", "tokenyard.cli", "engine", "--port", "0",
           "--max-num-seqs", "1", "--max-waiting-requests", "1", "--drain-timeout", "2"]
    token = {"TOKENYARD_REPLICA_TOKEN": secrets.token_urlsafe(16)}
    engine = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **token})
    assert engine.stdout is not None
    url, seen = None, []
    try:
        for line in engine.stdout:
            seen.append(line)
            if m := _ENGINE.search(line):
                url = m.group(1)
                break
        if url is None:
            pytest.fail("tokenyard engine did not start:\n" + "".join(seen[-40:]))
        # No waiting at the balancer: the replica's own full queue is what is tested.
        with running_server("--replica-url", url, "--no-auth", "--queue-timeout", "0",
                            env=token) as (server, _):
            yield server, engine
    finally:
        if engine.poll() is None:
            engine.send_signal(signal.SIGTERM)
            try:
                engine.wait(START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                engine.kill()


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                ) -> tuple[int, Any, bytes]:
    async with session.post(url, json=body) as r:
        return r.status, r.headers, await r.read()


def test_a_full_waiting_queue_sheds_with_503_and_529_and_retry_after(
    small_replica: tuple[Server, subprocess.Popen[str]],
) -> None:
    server, _ = small_replica
    chat = {"model": server.model, "messages": [{"role": "user", "content": "Count to 50."}],
            "max_tokens": 24}
    anthropic = {**chat, "max_tokens": 24}

    async def burst() -> list[tuple[str, int, Any, bytes]]:
        async with aiohttp.ClientSession() as session:
            calls = [("openai", _post(session, server.base_url + "/v1/chat/completions", chat))
                     for _ in range(4)]
            calls += [("anthropic", _post(session, server.base_url + "/v1/messages", anthropic))
                      for _ in range(4)]
            results = await asyncio.gather(*(c for _, c in calls))
            return [(api, *r) for (api, _), r in zip(calls, results, strict=True)]

    results = asyncio.run(burst())
    # One slot running and one waiting: of eight at once, at most two are served.
    served = [r for r in results if r[1] == 200]
    shed = [r for r in results if r[1] != 200]
    assert 1 <= len(served) <= 2 and len(shed) >= 6
    for api, status, headers, raw in shed:
        body = json.loads(raw)
        assert float(headers["retry-after"]) > 0
        if api == "openai":
            assert status == 503 and body["error"]["code"] == "server_is_overloaded"
        else:
            assert status == 529 and body["error"]["type"] == "overloaded_error"


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error_event(
    small_replica: tuple[Server, subprocess.Popen[str]],
) -> None:
    server, engine = small_replica
    body = {"model": server.model, "messages": [{"role": "user", "content": "Count to 500."}],
            "max_tokens": 400, "stream": True}

    async def stream_and_kill() -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as session, session.post(
            server.base_url + "/v1/chat/completions", json=body
        ) as r:
            raw = b""
            async for chunk in r.content.iter_any():
                raw += chunk
                if raw.count(b"data: ") == 4 and engine.poll() is None:
                    engine.kill()  # kill -9: no drain, the stream just breaks
            return r.status, raw

    status, raw = asyncio.run(asyncio.wait_for(stream_and_kill(), 120))
    assert status == 200
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] != b"[DONE]"
    last = json.loads(events[-1])
    assert last["error"]["message"] and last["error"]["type"]
    # The HTTP process stays up and says the engine is gone.
    async def after() -> tuple[int, int, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.get(server.base_url + "/readyz") as r:
                ready = r.status
            status, _, raw = await _post(
                session, server.base_url + "/v1/chat/completions",
                {**body, "stream": False, "max_tokens": 2})
            return ready, status, json.loads(raw)

    ready, status, err = asyncio.run(after())
    assert ready == 503 and status == 503 and err["error"]["type"]
