"""Background responses survive `kill -9`: a response queued with `background: true`
ends completed once, with one ledger row, when the gateway running it dies mid-run.

In front of a slow mock replica (50 ms a token, 60 tokens), so the kill lands while the
response streams. SQLite: the gateway is SIGKILLed once the response has streamed some
text, and started again on its state directory; the new process claims the response
again once its lease is past (2 s here) and runs it from the start. PostgreSQL: two
gateways share the store; the one running the response is SIGKILLed and the other
finishes it. Either way the response's events, read back as a resumed stream, run from
0 without a gap and end in one response.completed, and the ledger holds one row under
the response's id (its request id), priced at the live price.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import openai
import pytest

from tests.chaos.conftest import Recorder, mock_replica_process
from tests.e2e.conftest import Server, running_server
from tests.e2e.test_admin_http import call
from tests.integration.test_store_postgres import (  # noqa: F401
    postgres_admin_dsn,
    postgres_database,
)
from tests.integration.test_workers import poll
from tokenyard.store.money import Prices, cost_micros

pytestmark = pytest.mark.slow

ENV = {"TOKENYARD_BACKGROUND_LEASE_S": "2"}
TOKENS = 60
PRICES = Prices(input=2_000_000, cached_input=1_000_000, output=4_000_000)


@pytest.fixture(scope="module")
def slow_mock() -> Iterator[str]:
    with mock_replica_process(itl_ms=50, output_len=TOKENS) as url:
        yield url


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                         max_retries=3)


def _started(server: Server) -> str:
    """A background response, followed until it has streamed some text: its id."""
    client = _client(server)
    status, _ = call(server, "PUT", f"/admin/v1/prices/{server.model}",
                     body={"input": "2", "cached_input": "1", "output": "4"})
    assert status == 200
    queued = client.responses.create(model=server.model, input="Tell me a story.",
                                     background=True, max_output_tokens=TOKENS)
    assert queued.status == "queued" and queued.background
    deltas = 0
    with client.responses.retrieve(queued.id, stream=True) as events:
        for event in events:
            deltas += event.type == "response.output_text.delta"
            if deltas >= 5:
                break
    return queued.id


def _completed(server: Server, response_id: str) -> dict[str, Any]:
    """The response, waited for to its end (completed or incomplete: it ran out of its
    tokens), and its events read back whole, checked gap-free with one end."""
    client = _client(server)
    done = poll(lambda: client.responses.retrieve(response_id),
                lambda r: r.status not in ("queued", "in_progress"), 120, "its end")
    assert done.status in ("completed", "incomplete"), done
    assert done.output_text
    events = list(client.responses.retrieve(response_id, stream=True, starting_after=1))
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(2, 2 + len(events)))
    ends = [e for e in events if e.type in ("response.completed", "response.incomplete")]
    assert len(ends) == 1 and ends[0] is events[-1]
    text = "".join(getattr(e, "delta", "") for e in events
                   if e.type == "response.output_text.delta")
    assert text == done.output_text
    assert events[-1].response.usage is not None  # type: ignore[union-attr]
    return done.model_dump()


def _check_rows(rows: list[tuple[Any, ...]], response: dict[str, Any]) -> None:
    """One ledger row, under the response's id, priced at the live price."""
    assert len(rows) == 1, rows
    request_id, prompt, cached, output, cost = rows[0]
    assert request_id == response["id"]
    assert output == response["usage"]["output_tokens"] > 0
    assert cost == cost_micros(PRICES, prompt - cached, cached, output) > 0


def test_kill_9_mid_response_then_restart_sqlite(slow_mock: str, tmp_path: Path,
                                                 record: Recorder) -> None:
    db = tmp_path / "tokenyard.db"
    with running_server("--replica-url", slow_mock, state_dir=str(tmp_path), env=ENV,
                        check_exit=False) as (server, proc):
        response_id = _started(server)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    with sqlite3.connect(db) as conn:
        state, attempts = conn.execute("SELECT state, attempts FROM background_responses "
                                       "WHERE id = ?", (response_id,)).fetchone()
    assert (state, attempts) == ("running", 1)
    with running_server("--replica-url", slow_mock, state_dir=str(tmp_path),
                        env=ENV) as (server, _):
        response = _completed(server, response_id)
        with sqlite3.connect(db) as conn:
            rows = poll(lambda: conn.execute(
                "SELECT request_id, prompt_tokens, cached_tokens, output_tokens, cost_micros"
                " FROM usage_ledger WHERE request_id = ?", (response_id,)).fetchall(),
                lambda r: len(r) >= 1, 30, "its ledger row")
            attempts = conn.execute("SELECT attempts FROM background_responses "
                                    "WHERE id = ?", (response_id,)).fetchone()[0]
    _check_rows(rows, response)
    assert attempts == 2
    record("background_kill_9_sqlite", command="serve --replica-url <mock>; kill -9; restart",
           sent={"responses": 1, "max_output_tokens": TOKENS},
           held={"status": response["status"], "ledger_rows": len(rows),
                 "attempts": attempts})


def test_two_gateways_on_postgresql_one_killed(
        slow_mock: str, tmp_path: Path, record: Recorder,
        postgres_database: str) -> None:  # noqa: F811
    env = {**ENV, "TOKENYARD_DATABASE_URL": postgres_database}

    async def running() -> str:
        conn = await asyncpg.connect(postgres_database)
        try:
            return str(await conn.fetchval(
                "SELECT claimed_by FROM background_responses WHERE state = 'running'"))
        finally:
            await conn.close()

    # One state directory (the development key's file; each process journals apart).
    with running_server("--replica-url", slow_mock, state_dir=str(tmp_path), env=env,
                        check_exit=False) as (first, first_proc), \
         running_server("--replica-url", slow_mock, state_dir=str(tmp_path), env=env,
                        check_exit=False) as (second, second_proc):
        response_id = _started(first)
        worker = asyncio.run(running())
        # The worker's name holds its process id: kill the gateway running the response.
        pid = int(worker.split(":")[1])
        victim, survivor = ((first_proc, second) if pid == first_proc.pid
                            else (second_proc, first))
        assert pid in (first_proc.pid, second_proc.pid), worker
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
        response = _completed(survivor, response_id)

        async def read() -> tuple[list[tuple[Any, ...]], int]:
            conn = await asyncpg.connect(postgres_database)
            try:
                for _ in range(60):
                    rows = [tuple(r) for r in await conn.fetch(
                        "SELECT request_id, prompt_tokens, cached_tokens, output_tokens, "
                        "cost_micros FROM usage_ledger WHERE request_id = $1", response_id)]
                    if rows:
                        break
                    await asyncio.sleep(0.5)
                attempts = await conn.fetchval(
                    "SELECT attempts FROM background_responses WHERE id = $1", response_id)
                return rows, int(attempts)
            finally:
                await conn.close()

        rows, attempts = asyncio.run(read())
    _check_rows(rows, response)
    assert attempts == 2
    record("background_kill_9_postgres_two_gateways",
           command="two serve processes on PostgreSQL; kill -9 the one running it",
           sent={"responses": 1, "max_output_tokens": TOKENS},
           held={"status": response["status"], "ledger_rows": len(rows),
                 "attempts": attempts})
