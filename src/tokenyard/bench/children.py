"""The benchmarks' servers as subprocesses: a mock replica or ``tokenyard serve`` on a free
127.0.0.1 port, started, awaited until its banner shows it ready, and stopped.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenyard.bench.mock_core import MockConfig

START_TIMEOUT_S = 120.0
_MOCK_READY = re.compile(r"serving at (http://\S+)")
_TOKENYARD_URL = re.compile(r"tokenyard serving \S+ at (http://\S+)")
#: The last banner line `tokenyard serve` prints that the harness needs (the key is above).
_TOKENYARD_READY = re.compile(r"replica: (http://\S+)")
_API_KEY = re.compile(r"API key: (\S+)")


@dataclass
class Child:
    """A subprocess serving HTTP at `url`; its recent output lines are kept in `lines`."""

    proc: subprocess.Popen[str]
    url: str
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    #: Removed when the process is stopped (tokenyard's state directory).
    scratch: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def search(self, pattern: re.Pattern[str]) -> str | None:
        """The first group of the first output line matching `pattern`."""
        for line in list(self.lines):
            if m := pattern.search(line):
                return m.group(1)
        return None

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit code."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    return self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            return self.proc.wait()
        finally:
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)


def start_child(
    cmd: Sequence[str],
    ready: re.Pattern[str],
    url: re.Pattern[str] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> Child:
    """Start `cmd` (stdout and stderr merged) and wait for a line matching `ready`; the
    URL it serves is the first group of `url` (default: of `ready`) in its output so far.
    A thread keeps draining its output afterwards. `env` replaces the environment.

    Raises RuntimeError with the output's tail if it exits or times out first.
    """
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**(env or os.environ), "PYTHONUNBUFFERED": "1"})
    lines: deque[str] = deque(maxlen=200)
    event = threading.Event()

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if ready.search(line):
                event.set()
        event.set()  # it ended: let the caller see that

    threading.Thread(target=drain, daemon=True).start()
    event.wait(timeout_s)
    child = Child(proc, "", lines)
    found = child.search(url or ready)
    if proc.poll() is not None or found is None:
        child.stop(timeout_s=1.0)
        raise RuntimeError(f"{' '.join(cmd[:5])} did not start:\n" + "".join(list(lines)[-30:]))
    child.url = found
    return child


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for servers that take no port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_mock(config: MockConfig, seed: int = 0) -> Child:
    """The mock replica on a free 127.0.0.1 port."""
    c = config
    return start_child([
        sys.executable, "-m", "tokenyard.bench.mock_replica", "--port", "0",
        "--output-len", str(c.output_len), "--ttft-ms", str(c.ttft_ms), "--itl-ms",
        str(c.itl_ms), "--inject-429", str(c.inject_429), "--inject-503", str(c.inject_503),
        "--inject-500", str(c.inject_500), "--inject-stream-error",
        str(c.inject_stream_error), "--seed", str(seed),
    ], _MOCK_READY)


def start_tokenyard(
    replica_url: str | None, auth: bool = True, *, workers: int = 1, embeddings: bool = False,
    extra: Sequence[str] = (), env_extra: dict[str, str] | None = None,
    python: Sequence[str] = (), start_timeout_s: float = START_TIMEOUT_S,
    ready: re.Pattern[str] = _TOKENYARD_READY,
) -> tuple[Child, str | None]:
    """``tokenyard serve --replica-url`` on a free 127.0.0.1 port (it loads no model; with
    `replica_url` None it starts its own replica of the embedded model), and the API key
    its banner shows (None with `auth` off). `workers`: its HTTP worker processes
    (``--workers``); `embeddings`: start the embeddings pool too (no benchmark calls it);
    `extra`: more serve flags (e.g. ``--config FILE``); `env_extra`: more environment
    (e.g. the OTLP endpoint); `python`: the interpreter's own flags before ``-m
    tokenyard.cli`` (e.g. ``-m cProfile -o FILE``); `ready`: the banner line that shows it
    ready (default: its replica's URL; a default deployment loaded on demand has none
    yet). Variables of OpenTelemetry's not in
    `env_extra` are dropped, so tracing is on only when asked for.

    It gets a state directory of its own (its SQLite store, ledger journal and development
    key, removed when it stops) and neither TOKENYARD_DATABASE_URL nor TOKENYARD_REDIS_URL:
    a benchmark never writes to a real store. The edge's per-address limits are off.
    """
    scratch = Path(tempfile.mkdtemp(prefix="tokenyard-bench-"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("TOKENYARD_DATABASE_URL", "TOKENYARD_REDIS_URL")
           and not k.startswith("OTEL_")}
    env.update(env_extra or {})
    env["TOKENYARD_STATE_DIR"] = str(scratch)
    replica = ["--replica-url", replica_url] if replica_url else []
    cmd = [sys.executable, *python, "-m", "tokenyard.cli", "serve", *replica, "--port", "0",
           "--drain-timeout", "2", "--workers", str(workers),
           # The harness reads the banner's lines (the JSON log would hold no key).
           "--log-format", "text",
           # The load generator is one address sending at the rates the edge's
           # per-address limits exist to refuse: measure the gateway, not the refusals.
           "--edge-requests-per-s", "0", "--edge-connections-per-address", "0",
           *([] if auth else ["--no-auth"]), *([] if embeddings else ["--no-embeddings"]),
           *extra]
    try:
        child = start_child(cmd, ready, _TOKENYARD_URL, env, start_timeout_s)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    child.scratch = scratch
    return child, child.search(_API_KEY)


def start_otlp_sink() -> Child:
    """An OTLP/HTTP endpoint that discards what it gets (`otlp_sink.py`), on a free port."""
    return start_child([sys.executable, "-m", "tokenyard.bench.otlp_sink", "--port", "0"],
                       _MOCK_READY)
