"""`tokenyard chat` retries as the official SDKs do (issue 29 §7), run as the CLI itself
with its input piped in.

- Against a real `tokenyard serve` (over the mock replica) with a key of an org that has
  no credit: the gateway's 429 `insufficient_quota` says `x-should-retry: false`, so the
  CLI asks once and shows the error (it used to ask five times). The gateway's own count
  (the dashboard's recent requests of that org) says how many requests it saw.
- Against tests/unit/test_chat_client.py's scripted server, which records headers: every
  attempt of one message carries the same `Idempotency-Key`, the next message another,
  and `x-should-retry: true` makes even a 400 worth another attempt.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Server, running_server
from tests.integration.test_workers import mock_url
from tests.unit.test_chat_client import FakeServer, serve
from tokenyard.store import Database, Store

pytestmark = pytest.mark.slow
__all__ = ["mock_url"]  # the module fixture, shared


def chat_cli(base_url: str, key: str, lines: str, model: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenyard.cli", "chat", "--base-url", base_url,
         "--api-key", key, "--model", model, "--max-tokens", "4"],
        input=lines, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


def broke_key(state: Path) -> tuple[str, str]:
    """A key of a new prepaid org with no credit: (secret, org id)."""
    async def main() -> tuple[str, str]:
        db = await Database.open(f"sqlite+aiosqlite:///{state / 'tokenyard.db'}",
                                 upgrade=False)
        try:
            store = Store(db)
            org = await store.create_org(f"broke-{uuid.uuid4().hex[:8]}", balance_micros=0)
            secret, _ = await store.create_api_key(org.id, name="cli")
            return secret, org.id
        finally:
            await db.close()

    return asyncio.run(main())


def seen_by_gateway(server: Server, org_id: str) -> list[dict[str, Any]]:
    request = urllib.request.Request(server.base_url + "/admin/v1/dashboard?recent=200",
                                     headers=server.headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        recent = json.loads(response.read())["requests"]["recent"]
    return [r for r in recent if r["org_id"] == org_id]


def test_an_out_of_credit_429_is_asked_once(mock_url: str, tmp_path: Path) -> None:
    with running_server("--replica-url", mock_url, state_dir=str(tmp_path)) as (server, _):
        secret, org_id = broke_key(tmp_path)
        done = chat_cli(server.base_url + "/v1", secret, "Say hello.\n", server.model)
        assert done.returncode == 0, done.stderr
        assert "[error (429)" in done.stdout and "gave up" not in done.stdout, done.stdout
        seen = seen_by_gateway(server, org_id)
        assert [(r["path"], r["status"], r["error_code"]) for r in seen] == [
            ("/v1/chat/completions", 429, "insufficient_quota")], seen


def test_each_message_keeps_one_idempotency_key_across_its_retries() -> None:
    async def scenario() -> FakeServer:
        fake = FakeServer(["503", "400-retry"], ["Hi", "!"])
        async with serve(fake) as url:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tokenyard.cli", "chat", "--base-url", url,
                "--model", "smol", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(b"first\nsecond\n"), 120)
            assert proc.returncode == 0, err
            assert out.decode().count("Hi!") == 2, out
        return fake

    fake = asyncio.run(scenario())
    first, retried, answered, second = fake.idempotency_keys
    assert first is not None and first == retried == answered, fake.idempotency_keys
    assert second is not None and second != first
