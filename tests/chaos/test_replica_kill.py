"""`kill -9` of one of `serve --replicas 2`'s own replicas under streaming load.

Unlike tests/integration/test_fleet.py's (engines started by the test, restarted by the
test), here `serve` owns both replicas: the one killed must be restarted by `serve`
itself. Requests that had not begun streaming fail over to the survivor and succeed;
streams on the victim end with an error event, not a hang; the victim is back and
serving within a bound; then the invariants over both replicas, and one ledger row per
request that produced tokens.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.chaos.conftest import Recorder, Scale
from tests.chaos.invariants import check_quiescent, ledger_exactly_once
from tests.e2e.conftest import Server, child_pids, running_server
from tests.integration.test_fleet import StreamResult, stream

pytestmark = pytest.mark.slow


async def _replicas(session: aiohttp.ClientSession, server: Server) -> dict[str, dict[str, Any]]:
    """The pool's view of each replica of the served model, by its URL."""
    async with session.get(f"{server.base_url}/admin/v1/deployments",
                           headers=server.headers) as r:
        assert r.status == 200, await r.text()
        body = await r.json()
    deployment = next(d for d in body["data"] if d["name"] == server.model)
    return {m["id"]: m for m in deployment["replicas"]}


def _pid_on_port(parent: int, port: int) -> int:
    """The child of `parent` listening on `port` (replicas start on port 0, so their
    command lines do not say): its socket's inode in /proc/net/tcp, found among the
    children's open files."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for pid in child_pids(parent):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) in inodes:
                    return pid
            except OSError:
                continue
    raise AssertionError(f"no child of {parent} listens on port {port}")


def test_kill_9_of_a_served_replica_fails_over_and_it_comes_back(
    tmp_path: Path, scale: Scale, record: Recorder,
) -> None:
    streams = 32 if scale == "full" else 6
    with running_server("--replicas", "2", state_dir=str(tmp_path)) as (server, proc):
        async def scenario() -> dict[str, Any]:
            async with aiohttp.ClientSession() as session:
                before = await _replicas(session, server)
                assert len(before) == 2, before
                results = [StreamResult() for _ in range(streams)]
                running = [asyncio.create_task(stream(
                    session, server, f"Write a long story about the number {i}.",
                    model=server.model, max_tokens=48, out=r)) for i, r in enumerate(results)]
                await asyncio.wait_for(asyncio.gather(*(r.started.wait() for r in results)),
                                       120)
                loads = await _replicas(session, server)
                victim = max(loads, key=lambda url: loads[url]["inflight"])
                on_victim = loads[victim]["inflight"]
                os.kill(_pid_on_port(proc.pid, urlsplit(victim).port or 0), signal.SIGKILL)
                killed_at = time.monotonic()
                fresh = [asyncio.create_task(stream(session, server, f"Say {i}.",
                                                    model=server.model, max_tokens=8))
                         for i in range(streams)]
                old = await asyncio.wait_for(asyncio.gather(*running), 120)
                new = await asyncio.wait_for(asyncio.gather(*fresh), 120)
                # Restarted by serve on its port: healthy and serving again.
                deadline = time.monotonic() + 180
                while (now := await _replicas(session, server))[victim]["state"] != "healthy":
                    assert time.monotonic() < deadline, now
                    await asyncio.sleep(0.2)
                back_after = time.monotonic() - killed_at
                return {"old": old, "new": new, "on_victim": on_victim,
                        "back_after": back_after, "victim": victim}

        out = asyncio.run(scenario())
        old, new = out["old"], out["new"]
        for r in new:  # not yet streaming when the replica died: all failed over
            assert (r.status, r.error) == (200, None) and r.done, r
        broken = [r for r in old if r.error is not None]
        assert 0 < len(broken) <= out["on_victim"], old  # each with an error event
        assert all(r.done for r in old if r.error is None)
        quiet = check_quiescent(server, state_dir=str(tmp_path), timeout=30)
        produced = {r.request_id for r in [*old, *new] if r.content_chunks}
        ledger = ledger_exactly_once(str(tmp_path), produced)
    record("kill -9 of a replica under load", command="tokenyard serve --replicas 2",
           sent={"streams_running": streams, "streams_after_kill": streams},
           held={"streams_on_victim": out["on_victim"], "streams_broken": len(broken),
                 "failed_over_ok": len(new), "victim_back_after_s": round(out["back_after"], 1),
                 **ledger, **quiet})
