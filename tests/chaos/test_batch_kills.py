"""Batches survive `kill -9`: every line ends with exactly one result and one ledger row.

In front of a slow mock replica (50 ms a token, 8 tokens a line), so the kill lands
mid-batch. SQLite: the gateway is SIGKILLed once a quarter of the lines are done and
started again on its state directory; it resumes the batch (lines held by the dead
process are claimed again once their lease is past). PostgreSQL: two gateways share the
store and the batch; one is SIGKILLed, the other finishes it and replays the dead one's
journal (they share a state directory), so every line has its one ledger row without
a restart. Short scale (make test)
40 lines; full scale (make chaos) 500.
"""

from __future__ import annotations

import asyncio
import io
import json
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import openai
import pytest

from tests.chaos.conftest import Recorder, Scale, mock_replica_process
from tests.e2e.conftest import Server, running_server
from tests.e2e.test_admin_http import call
from tests.integration.test_store_postgres import (  # noqa: F401
    postgres_admin_dsn,
    postgres_database,
)
from tests.integration.test_workers import poll
from tokenyard.store.money import Prices, cost_micros

pytestmark = pytest.mark.slow

LEASE = {"TOKENYARD_BATCH_LEASE_S": "2"}


@pytest.fixture(scope="module")
def slow_mock() -> Iterator[str]:
    with mock_replica_process(itl_ms=50, output_len=8) as url:
        yield url


def _lines(server: Server, n: int) -> bytes:
    return "".join(json.dumps({
        "custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": server.model, "max_tokens": 8,
                 "messages": [{"role": "user", "content": f"Line {i}."}]}}) + "\n"
        for i in range(n)).encode()


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                         max_retries=3)


def _start(server: Server, n: int) -> str:
    client = _client(server)
    file = client.files.create(file=("in.jsonl", io.BytesIO(_lines(server, n))),
                               purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def _completed(server: Server, batch_id: str) -> int:
    batch = _client(server).batches.retrieve(batch_id)
    assert batch.request_counts is not None
    return batch.request_counts.completed


def _finished(server: Server, batch_id: str, n: int) -> list[dict[str, Any]]:
    """The batch, waited for to its end: its output lines (every one a 200)."""
    client = _client(server)
    batch = poll(lambda: client.batches.retrieve(batch_id),
                 lambda b: b.status == "completed", 300, "the batch's end")
    assert batch.request_counts is not None and batch.request_counts.completed == n
    assert batch.output_file_id is not None and batch.error_file_id is None
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"l{i}" for i in range(n))
    assert {o["response"]["status_code"] for o in out} == {200}
    return out


def test_kill_9_mid_batch_then_restart_sqlite(slow_mock: str, tmp_path: Path, scale: Scale,
                                              record: Recorder) -> None:
    n = 500 if scale == "full" else 40
    env = {**LEASE, "TOKENYARD_BATCH_CONCURRENCY": "8" if scale == "full" else "4"}
    db = tmp_path / "tokenyard.db"
    with running_server("--replica-url", slow_mock, state_dir=str(tmp_path), env=env,
                        check_exit=False) as (server, proc):
        status, _ = call(server, "PUT", f"/admin/v1/prices/{server.model}",
                         body={"input": "2", "cached_input": "1", "output": "4"})
        assert status == 200
        batch_id = _start(server, n)
        poll(lambda: _completed(server, batch_id), lambda c: c >= n // 4, 300,
             "a quarter of the lines")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    with sqlite3.connect(db) as conn:
        before = dict(conn.execute("SELECT line, result FROM batch_lines WHERE batch_id = ? "
                                   "AND state = 'done'", (batch_id,)).fetchall())
    assert n // 4 <= len(before) < n
    with running_server("--replica-url", slow_mock, state_dir=str(tmp_path),
                        env=env) as (server, _):
        out = _finished(server, batch_id, n)
        with sqlite3.connect(db) as conn:
            after = dict(conn.execute("SELECT line, result FROM batch_lines "
                                      "WHERE batch_id = ?", (batch_id,)).fetchall())
            rows = poll(lambda: conn.execute(
                "SELECT request_id, prompt_tokens, cached_tokens, output_tokens, cost_micros "
                "FROM usage_ledger WHERE batch_id = ?", (batch_id,)).fetchall(),
                lambda r: len(r) >= n, 30, "every line's row")
        status, usage = call(server, "GET", "/admin/v1/usage?group_by=batch")
        assert status == 200
        by_batch = {row["group"]: row for row in usage["data"]}
        assert by_batch[batch_id]["requests"] == n
    # Priced at the batch price: half the live one (2, 1 and 4 per million tokens).
    half = Prices(input=1_000_000, cached_input=500_000, output=2_000_000)
    for _, prompt, cached, output, cost in rows:
        assert cost == cost_micros(half, prompt - cached, cached, output) > 0
    # A line done before the kill was never run again; every line has one ledger row.
    assert all(after[line] == result for line, result in before.items())
    assert sorted(r[0] for r in rows) == sorted(o["response"]["request_id"] for o in out)
    record("batch_kill_9_sqlite", command="serve --replica-url <mock>; kill -9; restart",
           sent={"lines": n, "done_before_kill": len(before)},
           held={"results": len(out), "ledger_rows": len(rows), "rerun_done_lines": 0})


def test_two_gateways_on_postgresql_one_killed(slow_mock: str, tmp_path: Path, scale: Scale,
                                               record: Recorder,
                                               postgres_database: str) -> None:  # noqa: F811
    n = 500 if scale == "full" else 40
    env = {**LEASE, "TOKENYARD_DATABASE_URL": postgres_database,
           "TOKENYARD_BATCH_CONCURRENCY": "4"}
    # One state directory (the development key's file; each process journals apart).
    with running_server("--replica-url", slow_mock, state_dir=str(tmp_path), env=env,
                        check_exit=False) as (first, proc), \
         running_server("--replica-url", slow_mock, state_dir=str(tmp_path),
                        env=env) as (second, _):
        batch_id = _start(first, n)
        poll(lambda: _completed(second, batch_id), lambda c: c >= n // 4, 300,
             "a quarter of the lines")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        out = _finished(second, batch_id, n)

        async def read() -> tuple[list[str], int]:
            conn = await asyncpg.connect(postgres_database)
            try:
                for _ in range(60):
                    ids = [r[0] for r in await conn.fetch(
                        "SELECT request_id FROM usage_ledger WHERE batch_id = $1",
                        batch_id)]
                    if len(ids) >= len(out):
                        break
                    await asyncio.sleep(0.5)
                workers = await conn.fetchval(
                    "SELECT count(DISTINCT claimed_by) FROM batch_lines WHERE batch_id = $1",
                    batch_id)
                return ids, int(workers)
            finally:
                await conn.close()

        ids, workers = asyncio.run(read())
    # Every line has exactly one row: those the killed gateway settled but had not
    # committed were in its journal, which the live gateway replays (ORPHAN_SCAN_S).
    assert sorted(ids) == sorted(o["response"]["request_id"] for o in out)
    assert len(ids) == len(set(ids)) == n
    assert workers >= 2  # both gateways ran lines of the one batch
    record("batch_kill_9_postgres_two_gateways",
           command="two serve processes on PostgreSQL; kill -9 one",
           sent={"lines": n}, held={"results": len(out), "ledger_rows": len(ids),
                                    "workers": workers})

