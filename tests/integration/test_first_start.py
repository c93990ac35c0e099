"""The first start, as a person at a terminal sees it: `tokenyard serve` on a pseudo-
terminal (in front of the mock replica, so no model loads) logs text, not JSON, says in one
line that it migrated the new database rather than one line per migration, and its banner
leads with the chat page and the dashboard, then the API. With stderr a pipe the same log
is JSON, as the operations docs say."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_workers import mock_url
from tokenyard.cli.serve import banner
from tokenyard.telemetry import logs

__all__ = ["mock_url"]  # the module fixture, shared

START_TIMEOUT_S = 120.0


def first_start(mock_url: str, state: Path, *, tty: bool) -> list[str]:
    """The lines `serve` writes on a fresh state directory until its banner is out
    (stdout and stderr together, on a terminal when `tty`)."""
    env = {**os.environ, "TOKENYARD_STATE_DIR": str(state), "PYTHONUNBUFFERED": "1"}
    env.pop("TOKENYARD_DATABASE_URL", None)
    cmd = [sys.executable, "-m", "tokenyard.cli", "serve", "--port", "0", "--replica-url",
           mock_url, "--no-embeddings"]
    if tty:
        leader, follower = pty.openpty()
        proc = subprocess.Popen(cmd, stdout=follower, stderr=follower, env=env)
        os.close(follower)
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        assert proc.stdout is not None
        leader = proc.stdout.fileno()
    out = b""
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (b"replica: " not in out and b'"event": "banner"' not in out
               and time.monotonic() < deadline):
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the terminal closed: the process ended
                    break
                if not chunk:
                    break
                out += chunk
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        if tty:
            os.close(leader)
    text = out.decode("utf-8", "replace").replace("\r\n", "\n")
    assert "replica: " in text or '"event": "banner"' in text, text
    return text.splitlines()


def test_on_a_terminal_the_log_is_text_and_the_banner_leads_with_the_pages(
    mock_url: str, tmp_path: Path,
) -> None:
    lines = first_start(mock_url, tmp_path, tty=True)
    assert not [line for line in lines if line.startswith("{")], lines
    migrated = [line for line in lines if "database migrated" in line]
    assert len(migrated) == 1 and "event=\"migrated\"" in migrated[0], lines
    assert not [line for line in lines if "Running upgrade" in line], lines
    head = next(i for i, line in enumerate(lines) if line.startswith("tokenyard serving"))
    base = lines[head].rsplit(" at ", 1)[1]
    assert lines[head + 1].split()[:4] == ["Chat", "in", "the", "browser:"], lines[head:]
    assert f"{base}/ " in lines[head + 1] + " "
    assert lines[head + 2].split()[:2] == ["Dashboard:", f"{base}/dashboard"]
    api = [i for i, line in enumerate(lines) if "OpenAI base URL" in line]
    assert api and api[0] > head + 2


def test_with_stderr_a_pipe_every_line_is_json_and_the_key_stays_in_its_file(
        mock_url: str, tmp_path: Path) -> None:
    lines = [line for line in first_start(mock_url, tmp_path, tty=False) if line.strip()]
    logged = [json.loads(line) for line in lines]  # every line: the banner too
    assert [e["event"] for e in logged if e.get("event") == "migrated"] == ["migrated"]
    assert not [e for e in logged if e["logger"].startswith("alembic")], lines
    [banner] = [e for e in logged if e.get("event") == "banner"]
    key = (tmp_path / "dev-key").read_text().strip()
    assert banner["api_key"] == f"{key[:6]}…{key[-4:]}"
    assert banner["api_key_file"] == str((tmp_path / "dev-key").absolute())
    assert banner["openai_base_url"] == banner["base_url"] + "/v1"
    assert key not in "\n".join(lines)


def test_auto_follows_the_terminal_and_a_flag_forces(monkeypatch: pytest.MonkeyPatch) -> None:
    class Stream:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    monkeypatch.setattr(sys, "stderr", Stream(True))
    assert logs.resolve_format("auto") == "text" and logs.resolve_format(None) == "text"
    assert logs.resolve_format("json") == "json"
    monkeypatch.setattr(sys, "stderr", Stream(False))
    assert logs.resolve_format("auto") == "json" and logs.resolve_format("text") == "text"


def test_a_regional_banner_says_its_region() -> None:
    text = banner("http://h:1", "m", "http://r:2", None, None, "eu")
    assert "region: eu" in text and text.index("Chat") < text.index("OpenAI base URL")
