"""`tokenyard serve --workers 2` in front of the mock replica (the replica protocol on a
timer: the engine is not the point here): limits exact across the workers without Redis,
`/metrics` summing both, a SIGKILLed worker restarted with none of its settled usage lost,
and SIGTERM draining open streams. Each response names its worker (`x-tokenyard-worker`,
its pid), so the tests see both workers serve."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import redis

from tests.e2e.conftest import Server, child_pids, running_server
from tokenyard.cli.workers import WORKER_HEADER
from tokenyard.store import Database, Store

T = TypeVar("T")
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def mock_url() -> Iterator[str]:
    """The mock replica: 8 tokens per reply, one every 2 ms (all max_tokens with
    ignore_eos)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenyard.bench.mock_replica", "--port", "0",
         "--itl-ms", "2", "--output-len", "8"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"serving at (http://\S+)", line)
    assert match, line
    try:
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def serve_workers(mock_url: str, state: Path, **env: str) -> Any:
    """`tokenyard serve --workers 2` on the mock, on the state directory `state`."""
    return running_server("--replica-url", mock_url, "--workers", "2",
                          state_dir=str(state), env=env)


def poll(fn: Callable[[], T], done: Callable[[T], bool], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if done(value) or time.monotonic() > deadline:
            assert done(value), f"{what}: {value!r}"
            return value
        time.sleep(0.1)


def ledger(state: Path) -> dict[str, str]:
    """request id → status of every committed usage row."""
    with sqlite3.connect(state / "tokenyard.db") as db:
        return dict(db.execute("SELECT request_id, status FROM usage_ledger").fetchall())


def journaled(state: Path, pid: str) -> set[str]:
    """The request ids in the journal segments of worker `pid` (ledger-<pid>-*.jsonl)."""
    return {json.loads(line)["request_id"]
            for segment in (state / "journal").glob(f"worker-*/ledger-{pid}-*.jsonl")
            for line in segment.read_text().splitlines() if line.strip()}


def create_key(state: Path, **limits: int) -> tuple[str, str]:
    """A key of the default org with `limits`: its secret and its id."""
    async def main() -> tuple[str, str]:
        db = await Database.open(f"sqlite+aiosqlite:///{state / 'tokenyard.db'}",
                                 upgrade=False)
        try:
            store = Store(db)
            secret, record = await store.create_api_key("org_default", name="t", **limits)
            return secret, record.id
        finally:
            await db.close()

    return asyncio.run(main())


async def chat(server: Server, key: str | None = None, *, max_tokens: int = 4,
               **body: Any) -> tuple[int, str]:
    """One chat completion on a connection of its own (SO_REUSEPORT spreads connections,
    not requests): its status and the worker that answered."""
    headers = {"Authorization": f"Bearer {key}"} if key else server.headers
    async with aiohttp.ClientSession(headers=headers) as session, session.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": server.model, "messages": HELLO, "max_tokens": max_tokens, **body},
    ) as resp:
        await resp.read()
        return resp.status, resp.headers[WORKER_HEADER]


async def metrics(server: Server) -> tuple[str, dict[str, float]]:
    """The worker that answered GET /metrics, and the page's samples."""
    async with aiohttp.ClientSession() as session, session.get(
        f"{server.base_url}/metrics"
    ) as resp:
        assert resp.status == 200
        text = await resp.text()
        return resp.headers[WORKER_HEADER], {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


SUCCESS = 'tokenyard:request_success_total{finished_reason="length"}'


def test_limits_are_exact_across_two_workers_and_metrics_cover_both(
    mock_url: str, tmp_path: Path
) -> None:
    with serve_workers(mock_url, tmp_path) as (server, proc):
        workers = {str(p) for p in child_pids(proc.pid)}
        key, _ = create_key(tmp_path, rpm=5)

        async def scenario() -> None:
            # An RPM limit of 5 and twelve requests (more until both workers have answered
            # some): exactly five pass, wherever they land.
            outcomes = [await chat(server, key) for _ in range(12)]
            while len({worker for _, worker in outcomes}) < 2 and len(outcomes) < 60:
                outcomes.append(await chat(server, key))
            statuses = [status for status, _ in outcomes]
            assert statuses.count(200) == 5, outcomes
            assert statuses.count(429) == len(outcomes) - 5, outcomes
            seen = {worker for _, worker in outcomes}
            assert len(seen) == 2 and seen <= workers, (outcomes, workers)
            # Unlimited requests until each worker has served some; every /metrics page,
            # whichever worker answers it, counts all of them.
            served: dict[str, int] = {}
            while len(served) < 2 or min(served.values()) < 3:
                status, worker = await chat(server)
                assert status == 200
                served[worker] = served.get(worker, 0) + 1
            total = 5 + sum(served.values())
            answered: set[str] = set()
            while answered != set(served):
                worker, page = await metrics(server)
                answered.add(worker)
                assert page[SUCCESS] == total, (worker, page[SUCCESS], total)
                assert page["tokenyard:http_workers"] == 2
                assert page["tokenyard:generation_tokens_total"] == 4 * total

        asyncio.run(scenario())


def test_with_redis_limits_stay_exact_and_the_affinity_table_is_shared(
    mock_url: str, tmp_path: Path, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=1, socket_timeout=5)

    def affinity_entries() -> list[bytes]:
        """The table's keys naming this test's replica (the mock's port is its own)."""
        keys = list(client.scan_iter(match="{tokenyard:aff:}b:*", count=1000))
        values = client.mget(keys) if keys else []
        return [k for k, v in zip(keys, values, strict=True)
                if v is not None and v.decode().startswith(mock_url + "|")]

    long_prompt = [{"role": "user", "content": "Tell me about the sea. " * 20}]
    try:
        with serve_workers(mock_url, tmp_path, TOKENYARD_REDIS_URL=redis_url) as (server, _):
            key, key_id = create_key(tmp_path, rpm=5)

            async def scenario() -> None:
                outcomes = [await chat(server, key, messages=long_prompt) for _ in range(12)]
                while len({worker for _, worker in outcomes}) < 2 and len(outcomes) < 60:
                    outcomes.append(await chat(server, key, messages=long_prompt))
                statuses = [status for status, _ in outcomes]
                assert statuses.count(200) == 5, outcomes
                assert statuses.count(429) == len(outcomes) - 5, outcomes

            asyncio.run(scenario())
            # The bucket is Redis's (not the parent's limiter).
            assert client.exists("{tokenyard:rl:}key:" + key_id + ":rpm")
            # The workers' balancers recorded the prompt's blocks in Redis, where every
            # worker (and every gateway host) looks them up.
            assert affinity_entries()
    finally:
        for entry in affinity_entries():
            client.delete(entry)
        client.close()


def test_a_killed_worker_is_restarted_and_its_settled_usage_is_not_lost(
    mock_url: str, tmp_path: Path
) -> None:
    # Usage stays in each worker's journal (no timed flush, and no billing read that
    # flushes first): what a SIGKILL leaves behind.
    with serve_workers(mock_url, tmp_path, TOKENYARD_LEDGER_FLUSH_INTERVAL_S="3600",
                       TOKENYARD_BILLING_REFRESH_S="3600") as (server, proc):
        served: dict[str, int] = {}  # worker pid → requests it answered

        async def requests() -> None:
            while len(served) < 2 or min(served.values()) < 3:
                status, worker = await chat(server)
                assert status == 200
                served[worker] = served.get(worker, 0) + 1

        asyncio.run(requests())
        victim = min(served)
        # Settled: one journal line per request the victim answered (each is written
        # just after its response), none committed yet.
        settled = poll(lambda: journaled(tmp_path, victim),
                       lambda ids: len(ids) == served[victim], 10, "the victim's journal")
        assert ledger(tmp_path) == {}
        os.kill(int(victim), signal.SIGKILL)
        # The parent starts a worker in its place, whose start replays the journal.
        poll(lambda: {str(p) for p in child_pids(proc.pid)},
             lambda pids: len(pids) == 2 and victim not in pids, 60, "workers after the kill")
        rows = poll(lambda: ledger(tmp_path), lambda rows: settled <= set(rows), 30,
                    "the victim's rows, replayed")
        assert set(rows) == settled  # the survivor's are still only in its journal
        assert set(rows.values()) == {"completed"}

        async def after() -> None:
            # The new worker counts once it serves; the dead one's counts stay in the sums.
            deadline = time.monotonic() + 30
            while (page := (await metrics(server))[1])["tokenyard:http_workers"] != 2:
                assert time.monotonic() < deadline, page
                await asyncio.sleep(0.1)
            assert page[SUCCESS] == sum(served.values())
            status, worker = await chat(server)
            assert status == 200
            served[worker] = served.get(worker, 0) + 1

        asyncio.run(after())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    # The drain flushed the others' journals: one row per request, none lost or doubled.
    rows = ledger(tmp_path)
    assert len(rows) == sum(served.values()) and settled <= set(rows)


def test_sigterm_drains_open_streams_on_every_worker(mock_url: str, tmp_path: Path) -> None:
    with serve_workers(mock_url, tmp_path) as (server, proc):
        workers = {str(p) for p in child_pids(proc.pid)}

        async def stream(session: aiohttp.ClientSession, started: asyncio.Event,
                         seen: set[str]) -> tuple[int, bool]:
            # 150 tokens, one every 2 ms: the stream is open when SIGTERM arrives.
            async with session.post(f"{server.base_url}/v1/chat/completions", json={
                "model": server.model, "messages": HELLO, "max_tokens": 150,
                "ignore_eos": True, "stream": True,
            }) as resp:
                assert resp.status == 200
                seen.add(resp.headers[WORKER_HEADER])
                deltas, done = 0, False
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            deltas += 1
                            started.set()
                return deltas, done

        async def scenario() -> list[tuple[int, bool]]:
            seen: set[str] = set()
            tasks: list[asyncio.Task[tuple[int, bool]]] = []
            sessions = []
            # Open streams until both workers hold one.
            while seen != workers and len(tasks) < 40:
                session = aiohttp.ClientSession(headers=server.headers)
                sessions.append(session)
                started = asyncio.Event()
                tasks.append(asyncio.create_task(stream(session, started, seen)))
                await started.wait()
            assert seen == workers
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            # No new connection is taken while the open streams finish.
            with pytest.raises(aiohttp.ClientConnectionError):
                await chat(server)
            results = await asyncio.gather(*tasks)
            for session in sessions:
                await session.close()
            return results

        results = asyncio.run(scenario())
        assert proc.wait(30) == 0
    # Every open stream ran to its end, and each is in the ledger (only they) as completed.
    assert all(deltas > 100 and done for deltas, done in results), results
    assert sorted(ledger(tmp_path).values()) == ["completed"] * len(results)
