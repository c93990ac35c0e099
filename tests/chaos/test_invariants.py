"""The invariant checkers can fail: each is run, without a tokenyard server, on a state
that breaks it (and on one that keeps it, so that a checker failing always is caught too).

- `ledger_exactly_once` and `balances_match` read a SQLite ledger made as the store makes
  it (migrated to head, rows written by `commit_usage`);
- `check_quiescent` reads a stand-in gateway and replica: a local HTTP server answering
  the dashboard and the engine stats with figures the test sets.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.invariants import balances_match, check_quiescent, ledger_exactly_once
from tests.e2e.conftest import Server
from tests.e2e.test_gateway import _db_url
from tokenyard.store import Database, Store, UsageRecord
from tokenyard.store.ledger import commit_usage
from tokenyard.wire.protocol import STATS_PATH

# ------------------------------------------------------------------------------ the ledger


def _ledger(state_dir: Path, request_ids: list[str], *, credit: int = 0,
            cost: int = 0) -> str:
    """A migrated SQLite store in `state_dir` with one org (prepaid with `credit` micros)
    and a ledger row of `cost` micros per id; the org's id."""
    async def make() -> str:
        db = await Database.open(_db_url(str(state_dir)))
        try:
            org = await Store(db).create_org("ledger-test", balance_micros=credit)
            async with db.engine.begin() as conn:
                await commit_usage(conn, [
                    UsageRecord(request_id=rid, org_id=org.id, model="m",
                                endpoint="/v1/chat/completions", status="completed",
                                prompt_tokens=3, output_tokens=2, cost_micros=cost)
                    for rid in request_ids])
            return org.id
        finally:
            await db.close()

    return asyncio.run(make())


def test_ledger_exactly_once_holds_when_each_request_has_one_row(tmp_path: Path) -> None:
    _ledger(tmp_path, ["req_a", "req_b"])
    figures = ledger_exactly_once(str(tmp_path), {"req_a", "req_b"}, timeout=0.2)
    assert figures == {"ledger_rows": 2, "expected": 2, "missing": 0, "duplicated": 0}


def test_ledger_exactly_once_fails_on_a_missing_row(tmp_path: Path) -> None:
    _ledger(tmp_path, ["req_a"])
    with pytest.raises(AssertionError, match="missing req_b"):
        ledger_exactly_once(str(tmp_path), {"req_a", "req_b"}, timeout=0.2)


def test_ledger_exactly_once_fails_on_a_request_billed_twice(tmp_path: Path) -> None:
    # One client id (x-request-id "retry-1") settled twice: two rows, each id suffixed.
    _ledger(tmp_path, ["retry-1.0123456789abcdef", "retry-1.fedcba9876543210"])
    with pytest.raises(AssertionError, match="duplicated retry-1"):
        ledger_exactly_once(str(tmp_path), {"retry-1.0123456789abcdef"}, timeout=0.2,
                            client_prefix="retry-")


def test_balances_match_fails_when_a_balance_is_not_credit_minus_ledger(
        tmp_path: Path) -> None:
    org = _ledger(tmp_path, ["req_a", "req_b"], credit=1_000, cost=100)
    assert balances_match(str(tmp_path), {org: 1_000}) == {"orgs": 1,
                                                            "ledger_cost_micros": 200}
    with pytest.raises(AssertionError, match="balance 800 != 1500 - 200"):
        balances_match(str(tmp_path), {org: 1_500})


# ------------------------------------------------------------------------------ quiescence

QUIET_STATS = {"num_running": 0, "num_waiting": 0, "num_kv_blocks": 64,
               "num_free_kv_blocks": 60, "num_pinned_kv_blocks": 4}


class _Figures:
    """What the stand-in answers: engine stats, one deployment's inflight and queued, and
    the open admissions, all in `values`; `busy_reads`: how many reads of the stats still
    see one request running before it is quiet."""

    def __init__(self) -> None:
        self.values = {**QUIET_STATS, "inflight": 0, "queued": 0, "admissions_open": 0}
        self.busy_reads = 0

    def answer(self, path: str) -> dict[str, Any]:
        if path.startswith(STATS_PATH):
            stats = {name: self.values[name] for name in QUIET_STATS}
            if self.busy_reads > 0:
                self.busy_reads -= 1
                stats["num_running"] = 1
            return stats
        deployment = {"kind": "chat", "inflight": self.values["inflight"],
                      "queued": self.values["queued"], "replicas": []}
        return {"deployments": [deployment], "admissions_open": self.values["admissions_open"],
                "worker_pid": os.getpid()}


@pytest.fixture
def stand_in() -> Iterator[tuple[Server, _Figures]]:
    """A gateway and replica on one local port, answering what its `_Figures` say."""
    figures = _Figures()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(figures.answer(self.path)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # keep the test's output quiet
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        yield Server(base_url=url, model="m", replica_url=url, api_key="k",
                     replica_token="t"), figures
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_check_quiescent_holds_on_a_quiet_server(stand_in: tuple[Server, _Figures]) -> None:
    server, _ = stand_in
    held = check_quiescent(server, rss_bound_mb=1e6, timeout=0.3)
    assert held["quiescent"] is True and held["kv_blocks_in_use"] == 0


def test_check_quiescent_waits_for_work_that_winds_down(
        stand_in: tuple[Server, _Figures]) -> None:
    server, figures = stand_in
    figures.busy_reads = 3
    assert check_quiescent(server, rss_bound_mb=1e6, timeout=10)["running"] == 0
    assert figures.busy_reads == 0


@pytest.mark.parametrize(("change", "named"), [
    pytest.param(change, named, id=named) for change, named in [
        ({"num_running": 1}, "running=1"),
        ({"num_waiting": 2}, "waiting=2"),
        ({"num_free_kv_blocks": 57}, "kv_blocks_in_use=3"),
        ({"inflight": 1}, "pool_inflight=1"),
        ({"queued": 2}, "pool_queued=2"),
        ({"admissions_open": 1}, "admissions_open=1"),
    ]])
def test_check_quiescent_fails_while_something_is_still_running(
        stand_in: tuple[Server, _Figures], change: dict[str, int], named: str) -> None:
    server, figures = stand_in
    figures.values.update(change)
    with pytest.raises(AssertionError, match=named):
        check_quiescent(server, rss_bound_mb=1e6, timeout=0.3)


def test_check_quiescent_fails_over_its_memory_bound(
        stand_in: tuple[Server, _Figures]) -> None:
    server, _ = stand_in
    with pytest.raises(AssertionError, match="RSS"):
        check_quiescent(server, rss_bound_mb=1.0, timeout=0.3)
