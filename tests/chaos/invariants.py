"""What must hold once a chaos scenario's traffic stops, whatever the scenario did.

- `check_quiescent`: the replica runs nothing and holds no KV block, the HTTP side has
  no request in flight or queued at any pool and no rate-limit admission still open
  (each one holds concurrency slots), and the HTTP process's RSS is under a bound.
  Every figure comes from a read-only endpoint: the replica's ``/v1/engine/stats`` and
  the gateway's ``/admin/v1/dashboard`` (its ``admissions_open``, ``worker_pid``).
- `ledger_exactly_once`: every request that produced tokens has exactly one ledger row.
- `balances_match`: each prepaid org's balance is its credit minus its ledger rows' cost.

Each waits a bounded time (work winds down asynchronously: an abort reaches the replica
after the client's close, the ledger writer flushes in batches), then raises
AssertionError naming what is still off, and returns its figures for `record`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import ssl
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import func, select

from tests.e2e.conftest import Server
from tests.e2e.test_gateway import _ledger_rows, _with_store
from tokenyard.store import Database, Store
from tokenyard.store.journal import PATTERN as JOURNAL_PATTERN
from tokenyard.store.tables import balances, usage_ledger
from tokenyard.wire.protocol import STATS_PATH

DASHBOARD_PATH = "/admin/v1/dashboard?recent=0"
#: A generous ceiling for the HTTP process (tokenizer, no torch); a leak of a few MB per
#: request over a storm goes well past it.
DEFAULT_RSS_BOUND_MB = 800.0

T = TypeVar("T")


def _get_json(url: str, headers: Mapping[str, str],
              context: ssl.SSLContext | None = None) -> dict[str, Any]:
    request = urllib.request.Request(url, headers=dict(headers))
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        body: dict[str, Any] = json.loads(response.read())
        return body


def _settle_within(read: Callable[[], T], problems: Callable[[T], list[str]],
                   timeout: float, interval: float = 0.1) -> tuple[T, list[str]]:
    """Read until `problems(value)` is empty or `timeout` passes; the last value and its
    problems (empty: it held)."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        found = problems(value)
        if not found or time.monotonic() > deadline:
            return value, found
        time.sleep(interval)


def rss_mb(pid: int) -> float:
    """Resident set size of process `pid` in MiB (from /proc)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise AssertionError(f"no VmRSS for pid {pid}")


class RssPeaks:
    """The peak RSS (MiB) of named processes, sampled every `interval` s in a thread while
    used as a context manager: a leak that a scenario's end frees again still shows."""

    def __init__(self, pids: Mapping[str, int], interval: float = 0.1) -> None:
        self.pids, self.interval = dict(pids), interval
        self.peaks = {name: 0.0 for name in self.pids}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        """Read every process's RSS once; a process gone meanwhile is skipped."""
        for name, pid in self.pids.items():
            with contextlib.suppress(OSError, AssertionError):
                self.peaks[name] = max(self.peaks[name], rss_mb(pid))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> RssPeaks:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def replica_urls(server: Server, dashboard: Mapping[str, Any]) -> list[str]:
    """The chat replicas to ask: the banner's, and every pool member named by its URL
    (``serve --replicas N`` starts several)."""
    # The banner lists several replicas as "url1, url2": the fixture keeps "url1,".
    urls = {server.replica_url.rstrip(",").rstrip("/")}
    for deployment in dashboard.get("deployments", []):
        if deployment.get("kind") not in (None, "engine", "chat"):
            continue
        for member in deployment.get("replicas", []):
            mid = str(member.get("id", ""))
            if mid.startswith("http://") or mid.startswith("https://"):
                urls.add(mid.rstrip("/"))
    return sorted(urls)


def _quiet(server: Server, rss_bound_mb: float,
           context: ssl.SSLContext | None) -> tuple[dict[str, Any], list[str]]:
    """One reading of every figure and what in it is off."""
    dash = _get_json(server.base_url + DASHBOARD_PATH, server.headers, context)
    figures: dict[str, Any] = {"running": 0, "waiting": 0, "kv_blocks_in_use": 0,
                               "pool_inflight": 0, "pool_queued": 0}
    off: list[str] = []
    for url in replica_urls(server, dash):
        try:
            stats = _get_json(url + STATS_PATH, server.replica_headers)
        except OSError as exc:  # a replica killed by the scenario and not back yet
            off.append(f"replica {url} unreachable: {exc}")
            continue
        figures["running"] += stats["num_running"]
        figures["waiting"] += stats["num_waiting"]
        # Pinned blocks (cache_control) are kept on purpose, not in use by a request.
        figures["kv_blocks_in_use"] += (stats["num_kv_blocks"] - stats["num_free_kv_blocks"]
                                        - stats.get("num_pinned_kv_blocks", 0))
    for deployment in dash["deployments"]:
        figures["pool_inflight"] += deployment["inflight"]
        figures["pool_queued"] += deployment["queued"]
    figures["admissions_open"] = dash.get("admissions_open") or 0
    pid = int(dash["worker_pid"])
    figures["http_rss_mb"] = round(rss_mb(pid), 1)
    for name in ("running", "waiting", "kv_blocks_in_use", "pool_inflight", "pool_queued",
                 "admissions_open"):
        if figures[name]:
            off.append(f"{name}={figures[name]}")
    if figures["http_rss_mb"] > rss_bound_mb:
        off.append(f"HTTP process {pid} RSS {figures['http_rss_mb']} MiB > {rss_bound_mb}")
    return figures, off


def journal_orphans(state_dir: str) -> int:
    """Ledger journal segments under `state_dir` whose writer is dead and that no writer
    has replayed yet (store/journal.py: a live writer holds its segments' flock, so a
    segment we can lock is an orphan). The lock is held for a moment only; a writer
    starting in that moment skips the file and the next start replays it."""
    found = 0
    for path in (Path(state_dir) / "journal").glob(JOURNAL_PATTERN):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # replayed and removed meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            found += 1
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
    return found


def check_quiescent(server: Server, *, state_dir: str | None = None,
                    rss_bound_mb: float = DEFAULT_RSS_BOUND_MB, timeout: float = 15.0,
                    context: ssl.SSLContext | None = None) -> dict[str, int | float | bool]:
    """Wait (at most `timeout` s) until nothing runs or waits on any replica, no KV block
    is in use, no pool has a request in flight or queued, the gateway holds no rate-limit
    admission, and the HTTP process's RSS is at most `rss_bound_mb`; with `state_dir`,
    also no dead writer's ledger journal left unreplayed. AssertionError naming what is
    off otherwise; the figures when it holds. `context`: what verifies an HTTPS server's
    certificate (one from a test's own authority)."""
    def read() -> tuple[dict[str, Any], list[str]]:
        figures, off = _quiet(server, rss_bound_mb, context)
        if state_dir is not None:
            figures["journal_orphans"] = journal_orphans(state_dir)
            if figures["journal_orphans"]:
                off.append(f"journal_orphans={figures['journal_orphans']}")
        return figures, off

    (figures, off), _ = _settle_within(read, lambda r: r[1], timeout)
    assert not off, "not quiescent after {:.0f} s: {}".format(timeout, "; ".join(off))
    return {**figures, "quiescent": True}


def client_ids(rows: list[dict[str, Any]]) -> Counter[str]:
    """Rows per request as the client named it: the ledger's ids are unique by
    construction, but an id the client sent (x-request-id) is kept as its prefix
    (``<client id>.<16 hex>``), so two rows under one client id are one request billed
    twice. Ids the server chose (``req_…``) count as themselves."""
    return Counter(rid if rid.startswith("req_") else rid.rsplit(".", 1)[0]
                   for rid in (row["request_id"] for row in rows))


def _rows_at(database_url: str) -> list[dict[str, Any]]:
    """Every ledger row of the database at `database_url` (a server's PostgreSQL)."""
    async def main() -> list[dict[str, Any]]:
        db = await Database.open(database_url, upgrade=False)
        try:
            async with db.engine.connect() as conn:
                return [dict(r) for r in (await conn.execute(select(usage_ledger))).mappings()]
        finally:
            await db.close()

    return asyncio.run(main())


def ledger_exactly_once(state_dir: str, request_ids: Collection[str], *,
                        timeout: float = 10.0, database_url: str | None = None,
                        client_prefix: str | None = None) -> dict[str, int]:
    """Every id in `request_ids` (requests that produced tokens) has exactly one ledger row,
    and no request id has more than one; waits up to `timeout` s for the writer's batches.
    The ledger is the SQLite file in `state_dir`, or the database at `database_url`.
    `client_prefix`: the x-request-id prefix of every request of the scenario, including
    those the client never saw an id for (cut before the headers): none may have two rows.
    Returns {"ledger_rows", "expected", "missing", "duplicated"}."""
    wanted = set(request_ids)

    def ours(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [row for row in rows if row["request_id"] in wanted or (
            client_prefix is not None and row["request_id"].startswith(client_prefix))]

    def problems(rows: list[dict[str, Any]]) -> list[str]:
        counts = Counter(row["request_id"] for row in rows)
        missing = sorted(wanted - counts.keys())
        duplicated = sorted(rid for rid, n in client_ids(ours(rows)).items() if n > 1)
        return [*(f"missing {rid}" for rid in missing[:5]),
                *(f"duplicated {rid}" for rid in duplicated[:5])]

    def read() -> list[dict[str, Any]]:
        return _ledger_rows(state_dir) if database_url is None else _rows_at(database_url)

    rows, off = _settle_within(read, problems, timeout, 0.2)
    counts = Counter(row["request_id"] for row in rows)
    figures = {"ledger_rows": len(rows), "expected": len(wanted),
               "missing": len(wanted - counts.keys()),
               "duplicated": sum(1 for n in client_ids(ours(rows)).values() if n > 1)}
    assert not off, f"ledger not exactly once ({figures}): {'; '.join(off)}"
    return figures


def balances_match(state_dir: str, credits: Mapping[str, int]) -> dict[str, int]:
    """Each org in `credits` (org id → micros credited to it, which the store keeps only as
    the running balance) has balance == credit − the cost of its ledger rows. Returns
    {"orgs", "ledger_cost_micros"}."""
    async def read(store: Store) -> tuple[dict[str, int], dict[str, int]]:
        async with store.db.engine.connect() as conn:
            held = {r.org_id: int(r.balance_micros) for r in await conn.execute(
                select(balances.c.org_id, balances.c.balance_micros)
                .where(balances.c.org_id.in_(list(credits))))}
            spent = {r.org_id: int(r.cost) for r in await conn.execute(
                select(usage_ledger.c.org_id, func.sum(usage_ledger.c.cost_micros).label("cost"))
                .where(usage_ledger.c.org_id.in_(list(credits)))
                .group_by(usage_ledger.c.org_id))}
        return held, spent

    held, spent = _with_store(state_dir, read)
    off = [f"org {org}: balance {held.get(org)} != {credit} - {spent.get(org, 0)}"
           for org, credit in credits.items() if held.get(org) != credit - spent.get(org, 0)]
    assert not off, "balances do not match the ledger: " + "; ".join(off)
    return {"orgs": len(credits), "ledger_cost_micros": sum(spent.values())}
