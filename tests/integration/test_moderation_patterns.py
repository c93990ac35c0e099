"""Blocklist patterns with inline flags, through `tokenyard serve --config` (issue 29 §2).

A pattern such as ``(?i)hello`` used to pass the fleet file's validation and then kill
`serve` at start-up with a traceback (the classifier joined the patterns into one
``(?:…)|(?:…)`` alternation, where a global flag is an error). Now each pattern is
compiled on its own, as validation compiles it: the flagged one works, and one that
cannot compile stops `serve` with a one-line error naming the pattern and the deployment.
The deployment is an upstream in front of the project's mock OpenAI server (the replica
is not the point here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Server, running_server
from tests.integration.test_canary_shadow import Mocks
from tokenyard.store.repo import DEFAULT_ORG_ID

pytestmark = pytest.mark.slow

GUARDED = "guarded-2026-11-01"


def fleet_toml(url: str, pattern: str) -> str:
    return (f'[[deployments]]\nname = "{GUARDED}"\nkind = "upstream"\nmodel = "mock"\n'
            f'urls = ["{url}"]\n'
            '[deployments.moderation]\ninput = "block"\nclassifier = "blocklist"\n'
            f"patterns = {{ greeting = [{json.dumps(pattern)}, '(?s)never.here'] }}\n")


def call(server: Server, method: str, path: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(
        server.base_url + path, method=method, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **server.headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def mock_url() -> Iterator[str]:
    mocks = Mocks()
    try:
        yield mocks.start("upstream", output_len=4, itl_ms=0.0)
    finally:
        mocks.close()


def test_a_pattern_with_an_inline_global_flag_serves_and_blocks(mock_url: str) -> None:
    with tempfile.TemporaryDirectory(prefix="tokenyard-modpat-") as state:
        path = Path(state) / "fleet.toml"
        path.write_text(fleet_toml(mock_url, "(?i)\\bhello\\b"))
        with running_server("--config", str(path), state_dir=state) as (server, _):
            chat = {"model": GUARDED, "max_tokens": 4}
            status, body = call(server, "POST", "/v1/chat/completions", {
                **chat, "messages": [{"role": "user", "content": "Well, HELLO there."}]})
            assert status == 400 and body["error"]["code"] == "content_policy_violation", body
            status, body = call(server, "POST", "/v1/chat/completions", {
                **chat, "messages": [{"role": "user", "content": "Good morning."}]})
            assert status == 200, body

            # The org's policy route takes modes only: patterns sent there are refused
            # with the field named, not silently dropped.
            org_path = f"/admin/v1/orgs/{DEFAULT_ORG_ID}/moderation"
            status, body = call(server, "POST", org_path, {
                "input": "block", "patterns": {"greeting": ["(?i)hello"]}})
            assert status == 400 and body["error"]["param"] == "patterns", body
            assert "fleet file" in body["error"]["message"]


def test_a_pattern_that_cannot_compile_is_a_one_line_start_up_error(mock_url: str) -> None:
    with tempfile.TemporaryDirectory(prefix="tokenyard-modpat-") as state:
        path = Path(state) / "fleet.toml"
        path.write_text(fleet_toml(mock_url, "hello(?i)"))
        done = subprocess.run(
            [sys.executable, "-m", "tokenyard.cli", "serve", "--port", "0", "--config",
             str(path), "--no-embeddings"],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "TOKENYARD_STATE_DIR": state})
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "'hello(?i)'" in line and GUARDED in line and "patterns.greeting" in line, line
