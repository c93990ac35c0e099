"""Refusals counted: `tokenyard serve --workers 2` (a fleet file over the mock replica, with
an input blocklist) refuses one request of each class — auth, authorize, limit, billing,
moderation, validation, the edge's body cap — then a burst past the edge's per-address
rate; `tokenyard:requests_refused_total` on /metrics (whichever worker answers sums both)
grows by exactly one per refusal, labelled with its stage, status, code and route, and the
dashboard shows them for the last minute."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from tests.e2e.conftest import Server, running_server
from tests.integration.test_workers import mock_url
from tokenyard.cli.workers import WORKER_HEADER

__all__ = ["mock_url"]  # the module fixture, shared

CHAT = "/v1/chat/completions"
REFUSED = re.compile(r'^tokenyard:requests_refused_total\{(.*)\} (\S+)$', re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')
#: The edge's requests per second per address and worker, and the spacing that keeps the
#: test's own sequential requests under it.
EDGE_RATE, SPACING_S = 8, 0.2


def refusals(text: str) -> Counter[tuple[str, str, str, str]]:
    """(stage, status, code, route) → count, from a /metrics page."""
    out: Counter[tuple[str, str, str, str]] = Counter()
    for labels, value in REFUSED.findall(text):
        got = dict(LABEL.findall(labels))
        out[got["stage"], got["status"], got["code"], got["route"]] += int(float(value))
    return out


async def call(server: Server, method: str, path: str, *, key: str | None = "admin",
               body: Any = None, data: bytes | None = None) -> tuple[int, Any, str]:
    """One request on a connection of its own (so SO_REUSEPORT spreads them over the
    workers): status, JSON body, the worker that answered."""
    headers = {} if key is None else {
        "Authorization": f"Bearer {server.api_key if key == 'admin' else key}"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    async with aiohttp.ClientSession(headers=headers) as session, session.request(
            method, server.base_url + path, json=body, data=data) as resp:
        text = await resp.text()
        try:
            parsed = await resp.json(content_type=None)
        except ValueError:
            parsed = text
        return resp.status, parsed, resp.headers.get(WORKER_HEADER, "")


def chat_body(server: Server, text: str = "Say hello.") -> dict[str, Any]:
    return {"model": server.model, "max_tokens": 2,
            "messages": [{"role": "user", "content": text}]}


def code_of(body: Any) -> str:
    error = body["error"]
    return str(error.get("code") or error.get("type"))


def test_each_refusal_is_counted_once_across_two_workers(mock_url: str, tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        '[[deployments]]\nname = "mock-2026-11-26"\n'
        f'urls = ["{mock_url}"]\n'
        'moderation = { input = "block", classifier = "blocklist", '
        'patterns = { violence = ["forbidden-word"] } }\n')
    with running_server("--config", str(fleet), "--workers", "2", state_dir=str(tmp_path),
                        env={"TOKENYARD_MAX_BODY_BYTES": "20000",
                             "TOKENYARD_EDGE_REQUESTS_PER_S": str(EDGE_RATE)}) as (server, _):
        asyncio.run(_scenario(server))


async def _scenario(server: Server) -> None:
    async def paced(*args: Any, **kwargs: Any) -> tuple[int, Any, str]:
        await asyncio.sleep(SPACING_S)  # under the edge's rate, which the burst exceeds
        return await call(server, *args, **kwargs)

    # Keys: one per class that needs its own.
    _, narrow, _ = await paced("POST", "/admin/v1/keys",
                               body={"org_id": "org_default", "models": ["nothing-*"]})
    _, slow, _ = await paced("POST", "/admin/v1/keys", body={"org_id": "org_default",
                                                              "rpm": 1})
    _, broke_org, _ = await paced("POST", "/admin/v1/orgs", body={"name": "broke",
                                                                   "balance": "0"})
    _, broke, _ = await paced("POST", "/admin/v1/keys", body={"org_id": broke_org["id"]})
    _, page, _ = await paced("GET", "/metrics", key=None)
    before = refusals(page)
    body = chat_body(server)
    expected: Counter[tuple[str, str, str, str]] = Counter()
    workers: set[str] = set()

    async def refused(stage: str, status: int, *args: Any, **kwargs: Any) -> None:
        got, answer, worker = await paced(*args, **kwargs)
        assert got == status, (stage, answer)
        expected[stage, str(status), code_of(answer), args[1]] += 1
        workers.add(worker)

    await refused("auth", 401, "POST", CHAT, key=None, body=body)
    await refused("authorize", 403, "POST", CHAT, key=narrow["secret"], body=body)
    ok, answer, _ = await paced("POST", CHAT, key=slow["secret"], body=body)
    assert ok == 200, answer
    await refused("limit", 429, "POST", CHAT, key=slow["secret"], body=body)
    await refused("billing", 429, "POST", CHAT, key=broke["secret"], body=body)
    await refused("moderation", 400, "POST", CHAT, body=chat_body(server, "a forbidden-word"))
    await refused("validation", 400, "POST", CHAT, data=b"{not json")
    await refused("edge", 413, "POST", CHAT, body=chat_body(server, "x" * 30_000))
    # A burst past the edge's rate: each worker's bucket holds EDGE_RATE requests.
    await asyncio.sleep(1.5)
    burst = await asyncio.gather(*(call(server, "GET", "/v1/models") for _ in range(24)))
    over = [b for b in burst if b[0] == 429]
    assert len(over) >= 24 - 2 * EDGE_RATE, [b[0] for b in burst]
    assert all(b[0] in (200, 429) for b in burst)
    for _, answer, worker in over:
        expected["edge", "429", code_of(answer), "/v1/models"] += 1
        workers.add(worker)
    assert len(workers) == 2, workers  # both workers refused some
    await asyncio.sleep(1.5)
    _, page, _ = await call(server, "GET", "/metrics", key=None)
    after = refusals(page)
    grown = after - before
    assert grown == expected, (grown, expected)
    assert {k[1] for k in expected if k[0] == "limit"} == {"429"}
    # The dashboard reads the same counter: this minute's refusals by reason.
    await asyncio.sleep(SPACING_S)
    status, board, _ = await call(server, "GET", "/admin/v1/dashboard?recent=0")
    assert status == 200, board
    shown = {(r["stage"], str(r["status"]), r["code"], r["route"]): r["count"]
             for r in board["refusals"]}
    for labels, count in expected.items():
        assert shown.get(labels, 0) >= count, (labels, shown)
