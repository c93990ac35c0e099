"""What a tenant (a key without the admin scope) can read never carries an internal
address — the replica's URL, its host:port, the state directory — nor a Python exception's
text. Against one `tokenyard serve` of this module's own: every body such a key can reach
while the replica serves (replies, streams, its request records and stored responses,
listings, refusals, the open routes and pages), then the bodies of requests that fail
because the replica died under them (error replies, the streams' error events, their
records). An admin key still sees the replica in a request's record.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.conftest import Server, child_pids, running_server
from tests.e2e.test_admin_http import call

pytestmark = pytest.mark.slow

#: A Python exception's repr or traceback, as `f"{exc!r}"` or logging would write it.
_EXCEPTION = re.compile(r"\b[A-Z]\w*(?:Error|Exception)\(|Traceback \(most recent call")
HELLO = [{"role": "user", "content": "Say hello."}]
LONG = [{"role": "user", "content": "Write a long story about a dragon."}]


class Seen:
    """Every body the tenant got, by what was asked, and the request ids to look up."""

    def __init__(self, server: Server, key: str) -> None:
        self.server, self.key = server, key
        self.bodies: dict[str, str] = {}
        self.request_ids: list[str] = []

    async def fetch(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                    key: str | None = None) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {key or self.key}", "x-api-key": key or self.key,
                   "Content-Type": "application/json"}
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.request(
                method, self.server.base_url + path, data=data, headers=headers) as r:
            text = await r.text()
        label = f"{method} {path} {json.dumps(body)[:80] if body is not None else ''}"
        self.bodies[f"{label} #{len(self.bodies)}"] = text
        if "x-request-id" in r.headers and path.startswith("/v1/") and method == "POST":
            self.request_ids.append(r.headers["x-request-id"])
        return r.status, text

    def leaks(self) -> dict[str, list[str]]:
        """For each body that carries an internal address or exception text: what."""
        host_port = self.server.replica_url.split("://", 1)[1]
        needles = [self.server.replica_url, host_port, str(self.server.state_dir),
                   "site-packages", "/src/tokenyard/"]
        found = {label: [n for n in needles if n in text] + _EXCEPTION.findall(text)
                 for label, text in self.bodies.items()}
        return {label: what for label, what in found.items() if what}


def _tenant(server: Server) -> str:
    """A key without the admin scope, of an org that captures its bodies."""
    status, org = call(server, "POST", "/admin/v1/orgs", body={"name": "tenant"})
    assert status == 201, org
    status, _ = call(server, "POST", f"/admin/v1/orgs/{org['id']}/capture", body={})
    assert status == 200
    status, key = call(server, "POST", "/admin/v1/keys", body={"org_id": org["id"]})
    assert status == 201 and key["scopes"]["admin"] is False, key
    return str(key["secret"])


async def _while_serving(seen: Seen) -> None:
    model = seen.server.model
    chat = {"model": model, "messages": HELLO, "max_tokens": 3}
    await seen.fetch("GET", "/v1/models")
    await seen.fetch("GET", f"/v1/models/{model}")
    await seen.fetch("POST", "/v1/chat/completions", chat)
    await seen.fetch("POST", "/v1/chat/completions", {**chat, "stream": True,
                                                      "stream_options": {"include_usage": True}})
    await seen.fetch("POST", "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2})
    await seen.fetch("POST", "/v1/messages", chat)
    await seen.fetch("POST", "/v1/messages", {**chat, "stream": True})
    await seen.fetch("POST", "/v1/messages/count_tokens", {"model": model, "messages": HELLO})
    status, text = await seen.fetch("POST", "/v1/responses", {
        "model": model, "input": "Say hello.", "max_output_tokens": 3})
    assert status == 200, text
    response_id = json.loads(text)["id"]
    await seen.fetch("POST", "/v1/responses", {"model": model, "input": "Hi", "stream": True,
                                               "max_output_tokens": 3})
    for path in (f"/v1/responses/{response_id}", f"/v1/responses/{response_id}/input_items",
                 "/v1/responses/resp_nope", "/v1/requests/req_nope"):
        await seen.fetch("GET", path)
    # Refusals: the request's own faults, a model that is not served, the admin routes.
    await seen.fetch("POST", "/v1/chat/completions", {"model": "nope", "messages": HELLO})
    await seen.fetch("POST", "/v1/chat/completions", {"model": model, "messages": []})
    await seen.fetch("POST", "/v1/chat/completions", {**chat, "max_tokens": 10**6})
    await seen.fetch("POST", "/v1/chat/completions", raw=b'{"model": ')
    await seen.fetch("POST", "/v1/embeddings", {"model": model, "input": "hi"})
    await seen.fetch("POST", "/v1/chat/completions", chat, key="sk-ty-not-a-key")
    for path in ("/admin/v1/dashboard", "/admin/v1/deployments", "/admin/v1/orgs",
                 "/admin/v1/moderation/events"):
        await seen.fetch("GET", path)
    await seen.fetch("POST", "/admin/v1/replicas/drain", {
        "deployment": model, "replica": seen.server.replica_url})
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json", "/", "/dashboard"):
        await seen.fetch("GET", path)


def _replica_pid(server_pid: int) -> int:
    for pid in child_pids(server_pid):
        if "engine" in Path(f"/proc/{pid}/cmdline").read_text():
            return pid
    raise AssertionError("tokenyard serve has no engine child")


async def _when_the_replica_dies(seen: Seen, server_pid: int) -> None:
    """Long requests of each dialect in flight, streamed and not, when the replica is
    killed; then one more while it is gone."""
    model = seen.server.model
    long = {"model": model, "messages": LONG, "max_tokens": 1000, "ignore_eos": True}
    started: list[asyncio.Event] = []

    async def stream(path: str, body: dict[str, Any]) -> None:
        began = asyncio.Event()
        started.append(began)
        headers = {"Authorization": f"Bearer {seen.key}", "x-api-key": seen.key}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s, \
                s.post(seen.server.base_url + path, json=body, headers=headers) as r:
            seen.request_ids.append(r.headers["x-request-id"])
            chunks = []
            async for chunk in r.content.iter_any():
                chunks.append(chunk)
                began.set()
            seen.bodies[f"dying stream {path} #{len(seen.bodies)}"] = b"".join(
                chunks).decode()

    streams = [
        asyncio.ensure_future(stream("/v1/chat/completions", {**long, "stream": True})),
        asyncio.ensure_future(stream("/v1/messages", {**long, "stream": True})),
        asyncio.ensure_future(stream("/v1/responses", {
            "model": model, "input": "Write a long story.", "max_output_tokens": 1000,
            "stream": True})),
    ]
    plain = asyncio.ensure_future(seen.fetch("POST", "/v1/chat/completions", long))
    while len(started) < len(streams) or not all(e.is_set() for e in started):
        await asyncio.sleep(0.05)
    os.kill(_replica_pid(server_pid), signal.SIGKILL)
    await asyncio.gather(*streams)
    status, text = await plain
    assert status >= 500 or '"error"' in text, text  # it did not finish before the kill
    status, text = await seen.fetch("POST", "/v1/chat/completions", {
        "model": model, "messages": HELLO, "max_tokens": 2})
    assert status == 503, text


def test_no_tenant_visible_body_carries_an_internal_address_or_exception_text() -> None:
    with running_server() as (server, proc):
        seen = Seen(server, _tenant(server))
        asyncio.run(_while_serving(seen))
        asyncio.run(_when_the_replica_dies(seen, proc.pid))
        # Each request's record, as the tenant reads it (a stored response after failing
        # too); the admin, who operates the replicas, sees where a request ran.
        served = list(seen.request_ids)
        for request_id in served:
            asyncio.run(seen.fetch("GET", f"/v1/requests/{request_id}"))
        records = [json.loads(text) for label, text in seen.bodies.items()
                   if label.startswith("GET /v1/requests/req_") and "req_nope" not in label]
        assert records and all(r.get("replica", None) is None for r in records), records
        status, record = call(server, "GET", f"/v1/requests/{served[0]}")
        assert status == 200 and record["replica"] == server.replica_url
        assert seen.leaks() == {}
