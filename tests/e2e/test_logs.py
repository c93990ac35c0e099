"""The logs (telemetry/logs.py). On the session's server: one JSON line per request at its
end, whose id is the response's x-request-id and the ledger row's request_id, and that
holds no prompt or output text. On a second server over the session's replica (no model
to load): the start-up, replica drain and SIGHUP reload events as JSON lines. In a bare
process: lines still queued for the writing thread at exit are written."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, running_server


def _request_lines(server: Server, request_id: str) -> list[dict[str, Any]]:
    """The server's JSON log lines of request `request_id`."""
    out = []
    for line in list(server.output):
        if request_id in line and line.startswith("{"):
            record = json.loads(line)
            if record.get("request_id") == request_id:
                out.append(record)
    return out


def _event_lines(server: Server, event: str) -> list[dict[str, Any]]:
    """The server's JSON log lines of event `event`."""
    records = (json.loads(line) for line in list(server.output)
               if line.startswith("{") and f'"event": "{event}"' in line)
    return [record for record in records if record.get("event") == event]


def _wait(fn: Any, what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := fn()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.05)
    return value


def _ledger_row(server: Server, request_id: str) -> dict[str, Any] | None:
    assert server.state_dir is not None
    with sqlite3.connect(Path(server.state_dir) / "tokenyard.db") as db:
        db.row_factory = sqlite3.Row
        row = db.execute("SELECT * FROM usage_ledger WHERE request_id = ?",
                         (request_id,)).fetchone()
    return dict(row) if row is not None else None


def test_one_log_line_per_request_with_the_ledger_rows_id_and_no_prompt(
    server: Server,
) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key)
    marker = f"zebra{uuid.uuid4().hex[:10]}"  # must never reach the log
    messages: Any = [{"role": "user", "content": f"Say {marker} twice."}]
    raw = client.chat.completions.with_raw_response.create(
        model=server.model, messages=messages, max_tokens=4,
        extra_headers={"x-request-id": "log-test"})
    request_id = raw.headers["x-request-id"]
    reply = raw.parse()
    assert request_id.startswith("log-test.")
    streamed = client.chat.completions.with_raw_response.create(
        model=server.model, messages=messages, max_tokens=3, stream=True,
        stream_options={"include_usage": True})
    stream_id = streamed.headers["x-request-id"]
    chunks = list(streamed.parse())
    refused = client.chat.completions.with_raw_response
    with pytest.raises(openai.BadRequestError) as bad:
        refused.create(model=server.model, messages=messages, max_tokens=10**7)
    bad_id = bad.value.response.headers["x-request-id"]

    line = _wait(lambda: _request_lines(server, request_id), "the request's log line")[0]
    assert line["level"] == "info" and line["logger"] == "tokenyard.request"
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/chat/completions",
                                                               200)
    assert line["model"] == line["deployment"] == server.model
    assert reply.usage is not None
    assert (line["prompt_tokens"], line["output_tokens"]) == (
        reply.usage.prompt_tokens, reply.usage.completion_tokens)
    assert line["finish_reason"] == reply.choices[0].finish_reason
    assert line["org_id"] and line["key_prefix"] and line["replica"].startswith("http://")
    assert line["stream"] is False and line["error_code"] is None
    assert {"parse", "tokenize", "queue", "prefill"} <= set(line["timings_ms"])

    stream_line = _wait(lambda: _request_lines(server, stream_id), "the stream's line")[0]
    assert stream_line["stream"] is True and stream_line["status"] == 200
    assert chunks[-1].usage is not None
    assert stream_line["output_tokens"] == chunks[-1].usage.completion_tokens

    bad_line = _wait(lambda: _request_lines(server, bad_id), "the refusal's line")[0]
    assert (bad_line["status"], bad_line["error_code"]) == (400, "context_length_exceeded")

    row = _wait(lambda: _ledger_row(server, request_id), "the ledger row")
    assert (row["prompt_tokens"], row["output_tokens"]) == (
        line["prompt_tokens"], line["output_tokens"])
    # billed: the line's cost is the ledger row's (whatever price other tests set)
    assert Decimal(line["cost"]) == Decimal(row["cost_micros"]) / 10**6
    assert _wait(lambda: _ledger_row(server, stream_id), "the stream's ledger row")

    time.sleep(0.2)  # a second line (double logging) would come right after the first
    for rid in (request_id, stream_id, bad_id):
        assert len(_request_lines(server, rid)) == 1, rid
    assert not [text for text in server.output if marker in text]


def _fleet_file(replica_url: str, aliases: str = "") -> str:
    return f'[[deployments]]\nname = "events"\nurls = ["{replica_url}"]\n\n[aliases]\n{aliases}'


def test_start_up_drain_reload_and_shutdown_are_event_lines(server: Server, tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(_fleet_file(server.replica_url))
    # The session's replica, reached with its token: this server loads no model.
    env = {"TOKENYARD_REPLICA_TOKEN": server.replica_token or ""}
    with running_server("--config", str(fleet), env=env) as (events, proc):
        started = _wait(lambda: _event_lines(events, "started"), "the start-up line", 60)
        assert len(started) == 1
        line = started[0]
        port = int(events.base_url.rsplit(":", 1)[1])
        assert (line["level"], line["logger"]) == ("info", "tokenyard.serve")
        assert (line["model"], line["host"], line["port"]) == ("events", "127.0.0.1", port)
        assert line["deployments"] == {"events": [server.replica_url]}
        assert (line["workers"], line["auth"]) == (1, True)
        assert line["msg"] == f"serving events on port {port}" and line["ts"]

        drained = httpx.post(f"{events.base_url}/admin/v1/replicas/drain", timeout=60,
                             headers=events.headers,
                             json={"deployment": "events", "replica": server.replica_url})
        assert drained.status_code == 200, drained.text
        line = _wait(lambda: _event_lines(events, "replica_drain"), "the drain line", 60)[0]
        assert (line["level"], line["logger"]) == ("info", "tokenyard.balancer")
        assert (line["deployment"], line["replica"]) == ("events", server.replica_url)

        fleet.write_text(_fleet_file(server.replica_url, 'events-alias = "events"\n'))
        proc.send_signal(signal.SIGHUP)
        line = _wait(lambda: _event_lines(events, "reloaded"), "the reload line", 60)[0]
        assert (line["level"], line["logger"]) == ("info", "tokenyard.serve")
        assert line["file"] == str(fleet)
        assert (line["deployments"], line["aliases"], line["draining"]) == (
            ["events"], ["events-alias"], [])

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        line = _wait(lambda: _event_lines(events, "draining"), "the draining line", 10)[0]
        assert (line["level"], line["logger"], line["timeout_s"]) == (
            "info", "tokenyard.serve", 5.0)
        line = _wait(lambda: _event_lines(events, "drained"), "the drained line", 10)[0]
        assert line["logger"] == "tokenyard.serve" and line["seconds"] >= 0


def test_lines_still_queued_at_exit_are_written() -> None:
    """The lines go through a queue to a writing thread; a process that exits right after
    logging (as serve and its workers do after their drain) loses none of them."""
    count = 5000
    script = (
        "import logging, sys\n"
        "from tokenyard.telemetry import logs\n"
        "logs.configure('json', 'info')\n"
        f"for i in range({count}):\n"
        "    logging.getLogger('t').info('line %d', i, extra={'event': 'x', 'i': i})\n"
        "sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [line["i"] for line in lines] == list(range(count))
    assert lines[-1]["msg"] == f"line {count - 1}"
