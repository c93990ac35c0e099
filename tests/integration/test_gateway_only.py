"""A gateway-only `tokenyard serve` is small (issue 22, item 3): with ``--replica-url`` it
starts no model process of its own — no engine replica and, unless ``--embeddings`` asks
for it, no embeddings replica (~450 MB) — and says so by having no child processes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import running_server
from tokenyard.bench.proctree import child_pids

pytestmark = pytest.mark.slow


def _commands(pid: int) -> list[str]:
    out = []
    for child in child_pids(pid):
        try:
            out.append(Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
                       .decode())
        except OSError:
            continue
    return out


def test_replica_url_starts_no_model_process() -> None:
    mock = subprocess.Popen(
        [sys.executable, "-m", "tokenyard.bench.mock_replica", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert mock.stdout is not None
        match = re.search(r"serving at (http://\S+)", mock.stdout.readline())
        assert match, "the mock replica did not start"
        # embeddings=True: no --no-embeddings flag, serve's own default decides.
        with running_server("--replica-url", match.group(1), embeddings=True) as (_, proc):
            children = _commands(proc.pid)
            assert not any(" embed" in c or " engine" in c for c in children), children
    finally:
        mock.terminate()
        mock.wait(10)
