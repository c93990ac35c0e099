"""Tenants through the HTTP routes: the prefix cache is per org, priority classes reach the
engine's scheduler, and the default org has limits from its first request.

Orgs and keys are made with `/admin/v1` and the server's development (admin) key.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from tests.e2e.conftest import Server, replica_get, running_server

pytestmark = pytest.mark.slow


async def _admin(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession(headers=server.headers) as session, session.post(
        server.base_url + path, json=body
    ) as r:
        assert r.status in (200, 201), await r.text()
        result: dict[str, Any] = await r.json()
        return result


def new_key(server: Server, *, org_priority: str = "normal",
            key_priority: str | None = None) -> str:
    """A fresh org (with `org_priority`) and a key in it; the key's secret."""
    async def make() -> str:
        org = await _admin(server, "/admin/v1/orgs", {
            "name": f"tenant-{uuid.uuid4().hex[:8]}", "priority": org_priority})
        key = await _admin(server, "/admin/v1/keys",
                           {"org_id": org["id"], "priority": key_priority})
        return str(key["secret"])

    return asyncio.run(make())


def cached_tokens(server: Server, key: str, messages: list[dict[str, str]]) -> tuple[int, int]:
    """(prompt tokens, of which cached) of one chat completion with `key`."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(model=server.model, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=1, temperature=0)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens or 0


# ---------------------------------------------------------------------------- prefix cache


def test_an_org_hits_its_own_cached_prefix_and_never_another_org_s(server: Server) -> None:
    assert server.api_key is not None
    # Unique from its first words, so that no earlier test's blocks match it.
    text = f"{uuid.uuid4().hex} Summarise this. " + "The quick brown fox jumps. " * 40
    messages = [{"role": "user", "content": text}]
    prompt, _ = cached_tokens(server, server.api_key, messages)  # org "default" caches it
    assert prompt > 200
    _, again = cached_tokens(server, server.api_key, messages)
    assert again > prompt // 2, "the same org's second request was meant to hit the cache"

    other = new_key(server)
    _, other_org = cached_tokens(server, other, messages)
    assert other_org == 0, "another org was served from the first org's cached blocks"
    _, other_again = cached_tokens(server, other, messages)
    assert other_again > prompt // 2  # its own copy now, under its own salt


# ---------------------------------------------------------------------------- a fresh server


@pytest.fixture(scope="module")
def one_seq() -> Iterator[tuple[Server, dict[str, str]]]:
    """A server of this module's own, whose replica runs one request at a time (the rest
    wait in its queue), and the headers of the first response its development key got."""
    with running_server("--max-num-seqs", "1") as (server, _):
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                               max_retries=0)
        first = client.chat.completions.with_raw_response.create(
            model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        yield server, dict(first.headers)


def test_the_default_org_s_first_response_carries_rate_limit_headers(
    one_seq: tuple[Server, dict[str, str]],
) -> None:
    _, headers = one_seq
    # The documented defaults (docs/operations.md), this request already taken.
    assert headers["x-ratelimit-limit-requests"] == "10000"
    assert headers["x-ratelimit-remaining-requests"] == "9999"
    assert headers["x-ratelimit-limit-tokens"] == "10000000"
    assert int(headers["x-ratelimit-remaining-tokens"]) < 10_000_000


# ---------------------------------------------------------------------------- priority


def test_a_high_priority_key_s_request_overtakes_low_priority_ones_in_the_queue(
    one_seq: tuple[Server, dict[str, str]],
) -> None:
    server, _ = one_seq
    low = new_key(server, org_priority="low")  # follows its org: low
    high = new_key(server, org_priority="low", key_priority="high")  # overrides its org
    url = server.base_url + "/v1/chat/completions"

    def body(n: int) -> dict[str, Any]:
        return {"model": server.model, "messages": [{"role": "user", "content": "Count."}],
                "max_tokens": n, "min_tokens": n, "temperature": 0}

    async def post(session: aiohttp.ClientSession, key: str, n: int) -> float:
        async with session.post(url, json=body(n),
                                headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200, await r.text()
            await r.read()
        return time.monotonic()

    async def waiting(count: int) -> None:
        """Until the replica's queue holds `count` requests (not a fixed sleep: on a
        loaded machine a request may take longer than one to reach the queue)."""
        deadline = time.monotonic() + 60
        while (await asyncio.to_thread(replica_get, server, "/v1/engine/stats")
               )["num_waiting"] < count:
            assert time.monotonic() < deadline, f"fewer than {count} requests queued"
            await asyncio.sleep(0.05)

    async def main() -> tuple[float, float]:
        async with aiohttp.ClientSession() as session:
            # A long low-priority request takes the one running slot ...
            async with session.post(url, json={**body(200), "stream": True},
                                    headers={"Authorization": f"Bearer {low}"}) as running:
                assert running.status == 200
                await running.content.readline()  # it runs: its first event arrived
                # ... then a low-priority request queues, and a high-priority one after it.
                queued_low = asyncio.create_task(post(session, low, 8))
                await waiting(1)
                queued_high = asyncio.create_task(post(session, high, 8))
                await waiting(2)
                await running.read()
            return await queued_low, await queued_high

    low_done, high_done = asyncio.run(asyncio.wait_for(main(), 180))
    # The scheduler orders its queue by (priority, arrival): the later, high-priority
    # request ran first when the slot freed, and finished first.
    assert high_done < low_done, f"high finished {high_done - low_done:+.2f} s after low"
