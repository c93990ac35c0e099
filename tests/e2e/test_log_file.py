"""`tokenyard serve` writing to a file or a pipe (issue 40, logs): every line is one JSON
object — the banner, the replica child's lines and the drain included; the admin key
never appears (the banner masks it and names its file); health probes are not logged at
info; alembic's context lines do not appear; a clean drain logs no warning."""

from __future__ import annotations

import json
import time
import urllib.request

from tests.e2e.conftest import running_server


def _get(url: str, headers: dict[str, str] | None = None) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                timeout=60) as response:
        response.read()


def test_every_line_is_json_and_holds_no_key_no_probe_and_no_drain_warning() -> None:
    with running_server() as (server, _):
        for _ in range(3):
            _get(f"{server.base_url}/healthz")
            _get(f"{server.base_url}/readyz")
        _get(f"{server.base_url}/v1/models", server.headers)
        key = server.api_key
    deadline = time.monotonic() + 10
    while not any('"event": "drained"' in line for line in server.output):
        assert time.monotonic() < deadline, server.output[-20:]
        time.sleep(0.1)
    lines = [line for line in server.output if line.strip()]
    records = [json.loads(line) for line in lines]  # every line: one JSON object
    assert key is not None and key not in "".join(lines)
    events = [r.get("event") for r in records]
    assert events.count("banner") == 1 and "model_loaded" in events  # the child's line too
    paths = [r.get("path") for r in records if r["logger"] == "tokenyard.request"]
    assert "/v1/models" in paths and not {"/healthz", "/readyz"} & set(paths)
    assert not [r for r in records if r["logger"].startswith("alembic")]
    drain = events.index("draining")
    assert [r for r in records[drain:] if r["level"] in ("warning", "error")] == []
