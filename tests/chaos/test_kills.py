"""Kills and restarts: a gateway worker, and the Redis the limits live in.

Both in front of the mock replica (tests/integration/test_workers.py's: the replica
protocol on a timer), since what is killed here is not the engine; the engine's own
`kill -9` under load is tests/integration/test_fleet.py's and test_overload.py's.

- ``--workers 2``: requests with an ``Idempotency-Key`` each, the worker that answered
  some of them killed with SIGKILL; the parent starts another, whose start replays the
  dead worker's journal; every key retried then is replayed (``Idempotent-Replayed``),
  not run again, and each is in the ledger exactly once.
- Redis: a private ``redis-server`` on a free port (never the machine's shared one),
  killed under traffic: the limits fail closed (503, and 529 on /v1/messages, with
  retry-after, within a bounded time), and every request is served again once it is
  back (it was not: each idle pooled connection failed one request first — pinned by
  the last test).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.chaos.conftest import Recorder, Scale
from tests.chaos.invariants import check_quiescent, ledger_exactly_once
from tests.conftest import require_service
from tests.e2e.conftest import Server, child_pids, running_server
from tests.integration.test_workers import HELLO, mock_url, poll, serve_workers
from tokenyard.cli.workers import WORKER_HEADER
from tokenyard.gateway.idempotency import REPLAYED_HEADER
from tokenyard.gateway.limits import Limits, Subject
from tokenyard.gateway.redis_limits import RedisLimiter

pytestmark = pytest.mark.slow
__all__ = ["mock_url"]  # the module fixture, shared


async def _post(server: Server, path: str, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One POST on a connection of its own (SO_REUSEPORT spreads connections)."""
    async with aiohttp.ClientSession(headers=server.headers) as session, session.post(
        server.base_url + path, json=body, headers=headers or {},
    ) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


def _chat(server: Server) -> dict[str, Any]:
    return {"model": server.model, "messages": HELLO, "max_tokens": 4}


def test_a_killed_worker_loses_no_usage_and_idempotent_retries_are_billed_once(
    mock_url: str, tmp_path: Path, scale: Scale, record: Recorder,
) -> None:
    n = 200 if scale == "full" else 24
    with serve_workers(mock_url, tmp_path) as (server, proc):
        keys = [f"kill-{uuid.uuid4().hex[:12]}" for _ in range(n)]

        async def send(key: str) -> tuple[int, dict[str, str], bytes]:
            return await _post(server, "/v1/chat/completions", _chat(server),
                               {"Idempotency-Key": key})

        async def first_round() -> list[tuple[int, dict[str, str], bytes]]:
            return await asyncio.gather(*(send(k) for k in keys))

        first = asyncio.run(first_round())
        assert all(status == 200 for status, _, _ in first), [s for s, _, _ in first]
        workers = {h[WORKER_HEADER.lower()] for _, h, _ in first}
        victim = min(workers)
        os.kill(int(victim), signal.SIGKILL)
        poll(lambda: {str(p) for p in child_pids(proc.pid)},
             lambda pids: len(pids) == 2 and victim not in pids, 60, "workers after the kill")

        async def retries() -> list[tuple[int, dict[str, str], bytes]]:
            return await asyncio.gather(*(send(k) for k in keys))

        again = asyncio.run(retries())
        assert all(status == 200 for status, _, _ in again), [s for s, _, _ in again]
        assert all(h.get(REPLAYED_HEADER.lower()) == "true" for _, h, _ in again), again[0][1]
        assert [body for _, _, body in again] == [body for _, _, body in first]
        ids = {h["x-request-id"] for _, h, _ in first}
        ledger = ledger_exactly_once(str(tmp_path), ids)
        assert ledger["ledger_rows"] == n, ledger
        quiet = [check_quiescent(server, state_dir=str(tmp_path)) for _ in range(4)]
    record("kill -9 of a gateway worker",
           command="tokenyard serve --workers 2 --replica-url <mock replica>",
           sent={"requests": n, "idempotent_retries": n, "killed_worker_served":
                 sum(1 for _, h, _ in first if h[WORKER_HEADER.lower()] == victim)},
           held={"retries_replayed": n, **ledger, **quiet[-1]})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def private_redis() -> Iterator[tuple[int, Any]]:
    """A throwaway redis-server on a free port, no persistence: (port, restart), where
    restart(kill=True) kills it with SIGKILL and restart(kill=False) starts it again."""
    binary = shutil.which("redis-server")
    require_service("Redis", binary is not None, "redis-server is not installed")
    assert binary is not None
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "private redis-server did not start"
                time.sleep(0.05)

    def restart(kill: bool) -> None:
        if kill:
            procs[-1].kill()
            procs[-1].wait()
        else:
            start()

    start()
    try:
        yield port, restart
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_limits_fail_closed_while_redis_is_down_then_recover(
    mock_url: str, tmp_path: Path, scale: Scale, record: Recorder,
) -> None:
    per_phase = 60 if scale == "full" else 8
    with private_redis() as (port, restart), running_server(
        "--replica-url", mock_url, state_dir=str(tmp_path),
        env={"TOKENYARD_REDIS_URL": f"redis://127.0.0.1:{port}/0"},
    ) as (server, _):
        anthropic = {**_chat(server)}

        async def phase() -> list[tuple[str, int, dict[str, str], float]]:
            async def one(path: str) -> tuple[str, int, dict[str, str], float]:
                started = time.monotonic()
                status, headers, _ = await _post(server, path, anthropic if path ==
                                                 "/v1/messages" else _chat(server))
                return path, status, headers, time.monotonic() - started

            paths = ["/v1/chat/completions", "/v1/messages"] * (per_phase // 2)
            return await asyncio.gather(*(one(p) for p in paths))

        before = asyncio.run(phase())
        assert all(status == 200 for _, status, _, _ in before), before
        restart(True)
        down = asyncio.run(phase())
        for path, status, headers, _ in down:
            assert status == (529 if path == "/v1/messages" else 503), (path, status)
            assert float(headers["retry-after"]) > 0
        slowest_refusal = max(seconds for *_, seconds in down)
        assert slowest_refusal < 10, slowest_refusal
        restart(False)
        back_at = time.monotonic()

        def served() -> int:
            return asyncio.run(_post(server, "/v1/chat/completions", _chat(server)))[0]

        poll(served, lambda status: status == 200, 15, "served once Redis is back")
        recovery = time.monotonic() - back_at
        after = asyncio.run(phase())
        refused = [f"{p} {st}" for p, st, _, _ in after if st != 200]
        assert not refused, " | ".join(refused + [x for x in server.output if "fail" in x][-4:])
        ids = {h["x-request-id"] for _, status, h, _ in [*before, *after] if status == 200}
        ledger = ledger_exactly_once(str(tmp_path), ids)
        quiet = check_quiescent(server, state_dir=str(tmp_path))
    record("restart of Redis",
           command="tokenyard serve --replica-url <mock> with TOKENYARD_REDIS_URL on a "
                   "private redis-server, killed (SIGKILL) and restarted",
           sent={"requests_per_phase": per_phase, "phases": "up, down, up again"},
           held={"refused_while_down": len(down), "slowest_refusal_s": round(slowest_refusal, 3),
                 "recovery_s": round(recovery, 3), **ledger, **quiet})


def test_after_a_redis_restart_no_pooled_connection_fails_a_request() -> None:
    """Pins a bug this suite found: the limiter's idle pooled connections, dead once Redis
    restarted, each failed one admission (503) after Redis was back."""
    subjects = [Subject("key", f"restart-{uuid.uuid4().hex[:8]}", Limits(rpm=10_000))]

    async def burst(limiter: RedisLimiter) -> list[str]:
        outcomes = await asyncio.gather(*(limiter.admit(subjects, 1) for _ in range(8)),
                                        return_exceptions=True)
        return [type(o).__name__ if isinstance(o, BaseException) else "ok" for o in outcomes]

    with private_redis() as (port, restart):
        async def scenario() -> tuple[list[str], list[str]]:
            limiter = RedisLimiter(f"redis://127.0.0.1:{port}/0")
            try:
                first = await burst(limiter)  # eight connections in the pool
                restart(True)
                restart(False)
                return first, await burst(limiter)
            finally:
                await limiter.close()

        before, after = asyncio.run(scenario())
    assert before == after == ["ok"] * 8, (before, after)


PG_BIN = Path("/usr/lib/postgresql")


@contextmanager
def private_postgres() -> Iterator[tuple[str, Any]]:
    """A throwaway PostgreSQL cluster on a free port (trust auth, fsync off), run as the
    `postgres` user when this is root (initdb refuses root): (url, restart), where
    restart(stop=True) stops it at once (``-m immediate``: a crash) and restart(False)
    starts it again."""
    bins = sorted(PG_BIN.glob("*/bin"))
    require_service("PostgreSQL", bool(bins), f"no server binaries under {PG_BIN}")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    require_service("PostgreSQL", not as_user or shutil.which("runuser") is not None,
                    "this runs as root without runuser, and initdb refuses root")
    # Not under pytest's tmp_path: its parents are root's, closed to the postgres user.
    directory = Path(tempfile.mkdtemp(prefix="tokenyard-chaos-pg-"))
    if as_user:
        shutil.chown(directory, "postgres")
    port = _free_port()
    data = directory / "data"

    def pg(*args: str) -> None:
        subprocess.run([*as_user, str(bins[-1] / args[0]), *args[1:]], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)

    pg("initdb", "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    options = f"-p {port} -k {directory} -c listen_addresses=127.0.0.1 -c fsync=off"

    def restart(stop: bool) -> None:
        if stop:
            pg("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        else:
            pg("pg_ctl", "-D", str(data), "-o", options, "-l", str(directory / "log"),
               "-w", "start")

    restart(False)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres", restart
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            restart(True)
        shutil.rmtree(directory, ignore_errors=True)


def test_the_ledger_catches_up_after_a_postgres_restart(
    mock_url: str, tmp_path: Path, scale: Scale, record: Recorder,
) -> None:
    per_phase = 40 if scale == "full" else 8
    state = tmp_path / "state"
    with private_postgres() as (url, restart), running_server(
        "--replica-url", mock_url, state_dir=str(state),
        # The phases loop as fast as the server answers, from one address: past the
        # edge's per-address rate (api/edge.py), which is not what this scenario tests.
        env={"TOKENYARD_DATABASE_URL": url, "TOKENYARD_EDGE_REQUESTS_PER_S": "0"},
    ) as (server, _):
        async def phase() -> list[tuple[int, dict[str, str]]]:
            answers = await asyncio.gather(*(_post(server, "/v1/chat/completions",
                                                   _chat(server)) for _ in range(per_phase)))
            return [(status, headers) for status, headers, _ in answers]

        before = asyncio.run(phase())
        assert all(status == 200 for status, _ in before), before
        restart(True)
        down: list[tuple[int, dict[str, str]]] = []
        until = time.monotonic() + (10.0 if scale == "full" else 3.0)
        while time.monotonic() < until:
            down += asyncio.run(phase())
        for status, headers in down:  # served from the caches, or refused with retry-after
            assert status == 200 or (status == 503 and float(headers["retry-after"]) > 0), (
                status, headers)
        restart(False)
        back_at = time.monotonic()
        poll(lambda: asyncio.run(_post(server, "/v1/chat/completions", _chat(server)))[0],
             lambda status: status == 200, 20, "served once PostgreSQL is back")
        recovery = time.monotonic() - back_at
        after = asyncio.run(phase())
        assert all(status == 200 for status, _ in after), after
        ids = {h["x-request-id"] for status, h in [*before, *down, *after] if status == 200}
        ledger = ledger_exactly_once(str(state), ids, database_url=url, timeout=30)
        quiet = check_quiescent(server, state_dir=str(state))
    served_down = sum(1 for status, _ in down if status == 200)
    record("restart of PostgreSQL",
           command="tokenyard serve --replica-url <mock> with TOKENYARD_DATABASE_URL on a "
                   "private PostgreSQL cluster, stopped -m immediate and started again",
           sent={"requests_per_phase": per_phase, "requests_while_down": len(down)},
           held={"served_while_down": served_down,
                 "refused_503_while_down": len(down) - served_down,
                 "recovery_s": round(recovery, 3), **ledger, **quiet})


def test_an_idempotent_retry_of_a_request_whose_worker_died_runs_and_is_billed_once(
    tmp_path: Path, record: Recorder,
) -> None:
    """Pins a bug this suite found: the retry got 409 for the dead claim's whole lease."""
    slow = subprocess.Popen([sys.executable, "-m", "tokenyard.bench.mock_replica", "--port",
                             "0", "--itl-ms", "100", "--output-len", "30"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert slow.stdout is not None
        url = slow.stdout.readline().rsplit(" ", 1)[-1].strip()
        with serve_workers(url, tmp_path) as (server, proc):
            body = {**_chat(server), "max_tokens": 30, "stream": True}
            key = {"Idempotency-Key": f"inflight-{uuid.uuid4().hex[:8]}"}

            async def scenario() -> list[tuple[int, dict[str, str], bytes]]:
                async with aiohttp.ClientSession(headers=server.headers) as session, \
                        session.post(server.base_url + "/v1/chat/completions", json=body,
                                     headers=key) as r:
                    await r.content.readline()  # running on its worker: kill that
                    victim = int(r.headers[WORKER_HEADER])
                    os.kill(victim, signal.SIGKILL)
                    with contextlib.suppress(aiohttp.ClientError):
                        await r.read()
                # Until the kernel has torn the victim down, its SO_REUSEPORT listener can
                # still take a connection and then reset it (a ConnectionResetError at
                # connect, the CI failure): retry once the parent has reaped it, as a
                # client would retry a refused connection.
                await asyncio.to_thread(
                    poll, lambda: child_pids(proc.pid), lambda pids: victim not in pids,
                    30, "the killed worker reaped")
                return [await _post(server, "/v1/chat/completions", body, key)
                        for _ in range(2)]

            retried, replayed = asyncio.run(asyncio.wait_for(scenario(), 60))
            assert retried[0] == 200 and REPLAYED_HEADER.lower() not in retried[1], retried[:2]
            assert replayed[0] == 200 and replayed[1].get(REPLAYED_HEADER.lower()) == "true"
            assert replayed[2] == retried[2]
            ledger = ledger_exactly_once(str(tmp_path), {retried[1]["x-request-id"]})
            quiet = check_quiescent(server, state_dir=str(tmp_path), timeout=30)
    finally:
        slow.kill()
        slow.wait()
    record("idempotent retry after its worker died",
           command="tokenyard serve --workers 2 --replica-url <mock, 100 ms per token>",
           sent={"requests": 1, "retries": 2},
           held={"retry_status": retried[0], "second_retry_replayed": True, **ledger,
                 **quiet})
