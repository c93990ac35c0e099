"""A replica that dies mid-stream is reported as a replica failure (issue 29 §3).

`tokenyard serve --replica-url` in front of the mock replica (the replica protocol on a
timer), run as a process of its own so the test can SIGKILL it while two streams are
open: one on OpenAI's route, one on Anthropic's. Each stream must end with its dialect's
error event saying the replica failed (502-class: OpenAI's `server_error` with code
`replica_failed`, Anthropic's `api_error`), not `server_is_overloaded`, and each request's
record (GET /v1/requests/{id}) must say 502 and `replica_failed`, not 200.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from typing import Any

import aiohttp
import pytest

from tests.e2e.conftest import Server, running_server

pytestmark = pytest.mark.slow
HELLO = [{"role": "user", "content": "Say hello."}]


async def _open(session: aiohttp.ClientSession, server: Server, path: str,
                body: dict[str, Any]) -> tuple[aiohttp.ClientResponse, str]:
    """A stream open, its first content event read: the response and its request id."""
    resp = await session.post(server.base_url + path, json=body, headers=server.headers)
    assert resp.status == 200, await resp.text()
    async for raw in resp.content:
        if b'"content"' in raw or b"content_block_delta" in raw:
            break
    return resp, resp.headers["x-request-id"]


async def _rest(resp: aiohttp.ClientResponse) -> list[tuple[str | None, Any]]:
    """The stream's remaining events as (event name, data), to its end."""
    events: list[tuple[str | None, Any]] = []
    name: str | None = None
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            events.append((name, json.loads(line[6:])))
            name = None
    resp.release()
    return events


async def _record(session: aiohttp.ClientSession, server: Server,
                  request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        async with session.get(f"{server.base_url}/v1/requests/{request_id}",
                               headers=server.headers) as r:
            if r.status == 200 or time.monotonic() > deadline:
                assert r.status == 200, await r.text()
                return dict(await r.json())
        await asyncio.sleep(0.1)


def test_a_replica_killed_mid_stream_is_a_502_replica_failure_in_stream_and_record(
    tmp_path: Any,
) -> None:
    mock = subprocess.Popen(
        [sys.executable, "-m", "tokenyard.bench.mock_replica", "--port", "0",
         "--itl-ms", "20", "--output-len", "2000"], stdout=subprocess.PIPE, text=True)
    try:
        assert mock.stdout is not None
        match = re.search(r"serving at (http://\S+)", mock.stdout.readline())
        assert match
        with running_server("--replica-url", match.group(1),
                            state_dir=str(tmp_path)) as (server, _):
            async def scenario() -> None:
                async with aiohttp.ClientSession() as session:
                    chat, chat_id = await _open(session, server, "/v1/chat/completions", {
                        "model": server.model, "messages": HELLO, "stream": True,
                        "max_tokens": 1000, "ignore_eos": True})
                    msg, msg_id = await _open(session, server, "/v1/messages", {
                        "model": server.model, "messages": HELLO, "stream": True,
                        "max_tokens": 1000})
                    mock.send_signal(signal.SIGKILL)
                    mock.wait(10)
                    chat_events = await asyncio.wait_for(_rest(chat), 30)
                    msg_events = await asyncio.wait_for(_rest(msg), 30)

                    error = chat_events[-1][1]["error"]
                    assert error["code"] == "replica_failed", chat_events[-1]
                    assert error["type"] == "server_error", error
                    name, data = msg_events[-1]
                    assert name == "error" and data["error"]["type"] == "api_error", data
                    for request_id in (chat_id, msg_id):
                        record = await _record(session, server, request_id)
                        assert record["status"] == 502, record
                        assert record["error_code"] == "replica_failed", record

            asyncio.run(scenario())
    finally:
        if mock.poll() is None:
            mock.kill()
        mock.wait(10)
