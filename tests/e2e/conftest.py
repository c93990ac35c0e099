"""One `tokenyard serve` for the whole session (its `server` fixture is in
tests/conftest.py, shared with tests/browser), on a free 127.0.0.1 port.

The server prints a banner once it serves; the fixture reads the base URL and the
replica's URL from it (the disconnect test watches the replica's engine stats). Each server
gets a known TOKENYARD_REPLICA_TOKEN, which its child replica then requires: tests that call
the replica directly send `Server.replica_headers`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SERVER_OUTPUTS
from tokenyard.config import DEV_KEY_FILE

_SERVING = re.compile(r"tokenyard serving (\S+) at (https?://\S+)")
_REPLICA = re.compile(r"replica: (http://\S+)")
_API_KEY = re.compile(r"API key: (\S+)")
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Server:
    base_url: str
    model: str
    replica_url: str
    api_key: str | None = None  # None: served with --no-auth
    replica_token: str | None = None  # what the replica requires of its callers
    state_dir: str | None = None  # its SQLite file and ledger journal
    #: Every line the server wrote so far (stdout and stderr), read as it runs.
    output: list[str] = field(default_factory=list, compare=False, repr=False)

    @property
    def headers(self) -> dict[str, str]:
        """The bearer header every authenticated call needs."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def replica_headers(self) -> dict[str, str]:
        """The bearer header a direct call to the replica (stats, info) needs."""
        return {"Authorization": f"Bearer {self.replica_token}"} if self.replica_token else {}


def replica_get(server: Server, path: str) -> dict[str, Any]:
    """A GET on the replica itself (stats, info), with its token."""
    request = urllib.request.Request(server.replica_url + path,
                                     headers=server.replica_headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return dict(json.load(response))


def _read_banner(proc: subprocess.Popen[str], found: dict[str, str], ready: threading.Event,
                 lines: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("{") and '"event": "banner"' in line:  # --log-format json
            record = json.loads(line)
            found["model"], found["base_url"] = record["model"], record["base_url"]
            if record["api_key"]:
                found["api_key"] = record["api_key"]  # masked: the key file has it
            found["replica_url"] = record["replica"].split(", ")[0]
            ready.set()
            continue
        if m := _SERVING.search(line):
            found["model"], found["base_url"] = m.group(1), m.group(2)
        if m := _API_KEY.search(line):
            found["api_key"] = m.group(1)
        if m := _REPLICA.search(line):
            found["replica_url"] = m.group(1)
            ready.set()
    ready.set()  # the process ended: let the fixture fail with its output


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that needs the server loads the model: mark it slow."""
    for item in items:
        if "server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@contextlib.contextmanager
def running_server(
    *extra_args: str,
    env: dict[str, str] | None = None,
    state_dir: str | None = None,
    check_exit: bool = True,
    embeddings: bool = False,
) -> Iterator[tuple[Server, subprocess.Popen[str]]]:
    """`tokenyard serve` on a free port with `extra_args`; SIGTERM must end it with 0.

    `env`: extra environment variables (e.g. TOKENYARD_REDIS_URL; default
    TOKENYARD_REPLICA_TOKEN: a fresh random one). `state_dir`: serve on
    this state directory, which the caller owns (kept afterwards); default: a fresh
    temporary one, removed afterwards. `check_exit=False`: a test that killed the process
    itself skips the exit-code check. `embeddings`: also start the embeddings pool (off
    by default: most tests do not need its process)."""
    # Each server gets its own state directory: its SQLite file, journal and dev key.
    state = state_dir if state_dir is not None else tempfile.mkdtemp(prefix="tokenyard-e2e-")
    base = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENYARD_STATE_DIR": state}
    base.pop("TOKENYARD_DATABASE_URL", None)
    base.pop("TOKENYARD_REDIS_URL", None)
    base["TOKENYARD_REPLICA_TOKEN"] = secrets.token_urlsafe(16)
    env = {**base, **(env or {})}
    cmd = [sys.executable, "-m", "tokenyard.cli", "serve", "--port", "0",
           "--drain-timeout", "5", *extra_args, *([] if embeddings else ["--no-embeddings"])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    found: dict[str, str] = {}
    lines: list[str] = []
    ready = threading.Event()
    reader = threading.Thread(target=_read_banner, args=(proc, found, ready, lines),
                              daemon=True)
    reader.start()
    SERVER_OUTPUTS.append(lines)
    try:
        ready.wait(START_TIMEOUT_S)
        if "replica_url" not in found:
            pytest.fail("tokenyard serve did not start:\n" + "".join(lines[-40:]))
        api_key = found.get("api_key")
        if api_key is not None and "…" in api_key:  # masked: not the start that made it
            api_key = (Path(state) / DEV_KEY_FILE).read_text().strip()
        yield Server(found["base_url"], found["model"], found["replica_url"],
                     api_key, env["TOKENYARD_REPLICA_TOKEN"] or None, state, lines), proc
    finally:
        SERVER_OUTPUTS[:] = [out for out in SERVER_OUTPUTS if out is not lines]
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if state_dir is None:
            shutil.rmtree(state, ignore_errors=True)
        # Graceful shutdown is part of the contract: SIGTERM → exit 0.
        # (Unless it never started: then the failure above is the one to see.)
        assert code == 0 or not check_exit or "replica_url" not in found, "".join(lines[-40:])


def child_pids(pid: int) -> list[int]:
    """The direct children of process `pid` (from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def all_blocks_back(stats: dict[str, Any]) -> bool:
    """Every KV block free, but those a prompt-cache pin keeps (an Anthropic
    `cache_control` breakpoint another test of the session's server set holds its blocks
    for its TTL): nothing leaked."""
    return bool(stats["num_free_kv_blocks"] + stats.get("num_pinned_kv_blocks", 0)
                == stats["num_kv_blocks"])
