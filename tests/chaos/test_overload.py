"""Overload: ten times what the server can serve, arriving open-loop.

A server of its own with a small replica (`--max-num-seqs 2 --max-waiting-requests 2
--queue-timeout 0`), so that its capacity is quickly reached on any machine:

1. a probe request's latency, idle (the baseline);
2. the capacity: completions per second with every slot busy (closed loop, as many
   clients as running and waiting slots);
3. ten times that rate of streaming requests, alternating the OpenAI and Anthropic
   routes, for the scenario's duration: every answer is 200 or a refusal — 429, 503 or
   (Anthropic) 529 — that carries retry-after; the admitted requests' p99 TTFT is
   bounded by the queue they can wait in;
4. once the arrivals stop, the probe is served again within 5 s and its latency is back
   near the baseline; then the invariants, memory included.

Throughout, the RSS of the HTTP process and of the replica is sampled (every 0.1 s): the
HTTP process's peak stays under the quiescence check's bound, the replica's grows by at
most REPLICA_GROWTH_BOUND_MB (its KV pool is resident only where written).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.chaos.conftest import Recorder, Scale
from tests.chaos.invariants import (
    DEFAULT_RSS_BOUND_MB,
    RssPeaks,
    check_quiescent,
    ledger_exactly_once,
    rss_mb,
)
from tests.e2e.conftest import Server, child_pids, running_server

pytestmark = pytest.mark.slow

SLOTS = ("--max-num-seqs", "2", "--max-waiting-requests", "2", "--queue-timeout", "0")
REFUSALS = {429, 503, 529}
#: How much the replica's RSS may grow under the overload (four sequences at most).
REPLICA_GROWTH_BOUND_MB = 512.0


@pytest.fixture(scope="module")
def small() -> Iterator[tuple[Server, int]]:
    """The small server and its pid (the HTTP process; its one child is the replica)."""
    with running_server(*SLOTS) as (server, proc):
        yield server, proc.pid


def _body(server: Server, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": server.model, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": "Count from one to ten."}]}


async def _stream(session: aiohttp.ClientSession, server: Server, path: str
                  ) -> tuple[int, float | None, str | None, str | None]:
    """One streamed request: status, TTFT (s, 200 only), retry-after, request id."""
    started = time.monotonic()
    async with session.post(server.base_url + path, json=_body(server, 8, True)) as r:
        ttft = None
        async for line in r.content:
            if ttft is None and line.startswith((b"data: ", b"event: ")):
                ttft = time.monotonic() - started
        return (r.status, ttft if r.status == 200 else None, r.headers.get("retry-after"),
                r.headers.get("x-request-id"))


async def _probe(session: aiohttp.ClientSession, server: Server) -> tuple[int, float]:
    started = time.monotonic()
    async with session.post(server.base_url + "/v1/chat/completions",
                            json=_body(server, 4, False)) as r:
        await r.read()
        return r.status, time.monotonic() - started


async def _capacity(session: aiohttp.ClientSession, server: Server, seconds: float) -> float:
    """Completions per second with 4 clients (2 running + 2 waiting slots) in a loop."""
    done = 0
    end = time.monotonic() + seconds

    async def client() -> None:
        nonlocal done
        while time.monotonic() < end:
            status, *_ = await _stream(session, server, "/v1/chat/completions")
            done += status == 200
    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(4)))
    return done / (time.monotonic() - started)


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


def test_ten_times_capacity_is_refused_cleanly_and_recovers(
    small: tuple[Server, int], scale: Scale, record: Recorder,
) -> None:
    server, pid = small
    seconds = 60.0 if scale == "full" else 8.0
    (replica,) = child_pids(pid)
    replica_before = rss_mb(replica)

    async def scenario() -> dict[str, Any]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         headers=server.headers) as session:
            baseline = statistics.median([(await _probe(session, server))[1] for _ in range(3)])
            capacity = await _capacity(session, server, 3.0 if scale == "short" else 10.0)
            rate = 10 * capacity
            tasks = []
            started = time.monotonic()
            i = 0
            while (now := time.monotonic()) - started < seconds:
                path = "/v1/chat/completions" if i % 2 == 0 else "/v1/messages"
                tasks.append(asyncio.create_task(_stream(session, server, path)))
                i += 1
                await asyncio.sleep(max(0.0, started + i / rate - now))
            stopped = time.monotonic()  # the last arrival: "afterwards" starts here
            results = await asyncio.gather(*tasks)
            status, _ = await _probe(session, server)
            back_within = time.monotonic() - stopped
            after = statistics.median([(await _probe(session, server))[1] for _ in range(3)])
            return {"baseline": baseline, "capacity": capacity, "rate": rate,
                    "results": results, "first_probe": status, "back_within": back_within,
                    "after": after}

    with RssPeaks({"http": pid, "replica": replica}) as memory:
        out = asyncio.run(asyncio.wait_for(scenario(), seconds + 240))
    results = out["results"]
    statuses = Counter(status for status, *_ in results)
    assert set(statuses) <= {200} | REFUSALS, statuses
    refused = [r for r in results if r[0] in REFUSALS]
    assert refused, f"{len(results)} requests at 10x capacity and none refused"
    assert all(r[2] is not None and float(r[2]) > 0 for r in refused), refused[:3]
    ttfts = [ttft for status, ttft, *_ in results if status == 200 and ttft is not None]
    p99 = _p99(ttfts)
    # Two running and two waiting: an admitted request waits for at most two others.
    assert p99 < max(5.0, 10 * out["baseline"]), (p99, out["baseline"])
    assert out["first_probe"] == 200 and out["back_within"] < 5.0, out
    assert out["after"] < 2 * out["baseline"] + 0.5, (out["after"], out["baseline"])
    # Both read at least once: a peak of 0 would pass the bounds without a sample.
    assert min(memory.peaks.values()) > 0, memory.peaks
    assert memory.peaks["http"] < DEFAULT_RSS_BOUND_MB, memory.peaks
    assert memory.peaks["replica"] - replica_before < REPLICA_GROWTH_BOUND_MB, (
        replica_before, memory.peaks)
    ids = {rid for status, _, _, rid in results if status == 200 and rid}
    quiet = check_quiescent(server)
    assert server.state_dir is not None
    ledger = ledger_exactly_once(server.state_dir, ids)
    record("overload at 10x capacity", command="tokenyard serve " + " ".join(SLOTS),
           sent={"seconds": seconds, "capacity_rps": round(out["capacity"], 2),
                 "rate_rps": round(out["rate"], 2), "requests": len(results)},
           held={"statuses": ",".join(f"{k}:{v}" for k, v in sorted(statuses.items())),
                 "refusals_with_retry_after": len(refused),
                 "admitted_p99_ttft_s": round(p99, 3),
                 "probe_baseline_s": round(out["baseline"], 3),
                 "probe_after_s": round(out["after"], 3),
                 "served_again_within_s": round(out["back_within"], 3),
                 "http_rss_peak_mb": round(memory.peaks["http"], 1),
                 "replica_rss_before_mb": round(replica_before, 1),
                 "replica_rss_peak_mb": round(memory.peaks["replica"], 1),
                 "rss_samples": memory.samples, **quiet, **ledger})
