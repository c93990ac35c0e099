"""The balancer's full-pool queue keeps arrival order within a priority class (issue 29,
defect 4), through HTTP.

A server of its own whose replica runs one request and lets one more wait: past that,
requests wait at the balancer. Three low-priority requests queued there must reach the
replica, and so finish, in the order they came. Before the fix every waiter looked again
every half second and went back into the queue with a new sequence number (and whichever
timer fired first after room appeared took it), so the three finished in any order
(the issue saw 2, 3, 1).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.e2e.conftest import Server, replica_get, running_server
from tests.e2e.test_tenancy import new_key

pytestmark = pytest.mark.slow

#: The queued requests, sent in this order.
QUEUED = ("first", "second", "third")


@pytest.fixture(scope="module")
def one_slot() -> Iterator[Server]:
    """One running and one waiting place at the replica; the balancer waits up to 2 min."""
    with running_server("--max-num-seqs", "1", "--max-waiting-requests", "1",
                        "--queue-timeout", "120") as (server, _):
        yield server


async def _until(check: Any, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_queued_requests_of_one_class_finish_in_arrival_order(one_slot: Server) -> None:
    server = one_slot
    key = new_key(server, org_priority="low")
    url = server.base_url + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {key}"}

    def body(n: int) -> dict[str, Any]:
        return {"model": server.model, "messages": [{"role": "user", "content": "Count."}],
                "max_tokens": n, "min_tokens": n, "temperature": 0}

    def replica_has(running: int, waiting: int) -> bool:
        stats = replica_get(server, "/v1/engine/stats")
        return bool(stats["num_running"] == running and stats["num_waiting"] == waiting)

    finished: list[str] = []

    async def post(session: aiohttp.ClientSession, name: str) -> None:
        async with session.post(url, json=body(4), headers=headers) as r:
            assert r.status == 200, await r.text()
            await r.read()
        finished.append(name)

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            # A long request takes the running place, a short one the waiting place ...
            # (the most a request may ask for, 1,024 tokens, ~5 s on a Zen 5: it must
            # outlast the ~3.5 s below, and 400 tokens took 2 s there, the queue drained
            # before the check; leaving the stream aborts it)
            async with session.post(url, json={**body(1024), "stream": True},
                                    headers=headers) as running:
                assert running.status == 200
                await running.content.readline()
                filler = asyncio.create_task(post(session, "filler"))
                await _until(lambda: replica_has(1, 1), "the replica's waiting place")
                # ... so these three wait at the balancer, through several of its looks
                # again (every 0.5 s), a phase apart.
                queued = []
                for name in QUEUED:
                    queued.append(asyncio.create_task(post(session, name)))
                    await asyncio.sleep(0.65)
                await asyncio.sleep(1.0)
                assert not finished and replica_has(1, 1)
            # Leaving the stream aborts the long request: room, one place at a time.
            await asyncio.gather(filler, *queued)

    asyncio.run(asyncio.wait_for(main(), 240))
    assert finished == ["filler", *QUEUED], finished
