"""The chaos suite's two fixtures: `scale` (how hard a scenario pushes) and `record`
(what it sent and what held, one JSON line each, for tests/chaos/report.py).

`TOKENYARD_CHAOS=full` selects the full scale (`make chaos`); anything else the short
one that `make test` runs. `TOKENYARD_CHAOS_RESULTS` names the JSON-lines file the
records go to; unset, recording is a no-op so a plain pytest run writes nothing. With it
set, the run's start and end go there too (the report states the total run time).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, Protocol

import pytest

Scale = Literal["short", "full"]
Figure = int | float | str | bool


def chaos_scale() -> Scale:
    """"full" when TOKENYARD_CHAOS=full, else "short"."""
    return "full" if os.environ.get("TOKENYARD_CHAOS", "").strip().lower() == "full" else "short"


class Recorder(Protocol):
    def __call__(self, scenario: str, *, command: str, sent: dict[str, int | float | str],
                 held: dict[str, Figure]) -> None: ...


def results_file() -> Path | None:
    """The file TOKENYARD_CHAOS_RESULTS names, or None when it is unset."""
    target = os.environ.get("TOKENYARD_CHAOS_RESULTS", "").strip()
    return Path(target) if target else None


def append_line(path: Path, line: dict[str, object]) -> None:
    """Append `line`, stamped with the UTC time, to `path` as one JSON line."""
    stamped = {**line, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(stamped, sort_keys=True) + "\n")


def append_record(path: Path, scenario: str, *, command: str,
                  sent: dict[str, int | float | str], held: dict[str, Figure],
                  scale: Scale, test: str = "") -> None:
    """Append one scenario's outcome to `path` as a JSON line; `test`: the node id of the
    test that ran it."""
    append_line(path, {"scenario": scenario, "command": command, "scale": scale,
                       "sent": sent, "held": held, "test": test})


#: monotonic() at the session's start, for the run time written at its end.
_STARTED: list[float] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    """Mark the run's start in the results file (called when tests/chaos is named on the
    command line, as `make chaos` does)."""
    target = results_file()
    if target is not None:
        _STARTED.append(time.monotonic())
        append_line(target, {"run": "start"})


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Mark the run's end and its length, in seconds, in the results file."""
    target = results_file()
    if target is not None and _STARTED:
        append_line(target, {"run": "end", "exitstatus": int(exitstatus),
                             "seconds": round(time.monotonic() - _STARTED[-1], 1)})


@pytest.fixture(scope="session")
def scale() -> Scale:
    """How hard the scenarios push: "short" (make test) or "full" (make chaos)."""
    return chaos_scale()


class ScenarioRecorder:
    """`record` for one test: appends its records to the results file (if any), and at
    `finish` an "unrecorded" line when the test never called it."""

    def __init__(self, scale: Scale, test: str) -> None:
        self.scale, self.test, self.calls = scale, test, 0

    def __call__(self, scenario: str, *, command: str, sent: dict[str, int | float | str],
                 held: dict[str, Figure]) -> None:
        self.calls += 1
        target = results_file()
        if target is not None:
            append_record(target, scenario, command=command, sent=sent, held=held,
                          scale=self.scale, test=self.test)

    def finish(self) -> None:
        """Leave the "unrecorded" line for a test that recorded nothing."""
        target = results_file()
        if target is not None and not self.calls:
            append_line(target, {"unrecorded": self.test})


@pytest.fixture
def record(scale: Scale, request: pytest.FixtureRequest) -> Iterator[Recorder]:
    """`record(scenario, command=..., sent=..., held=...)`: one line in the results file
    named by TOKENYARD_CHAOS_RESULTS; nothing when it is unset. A test that asked for it
    and never called it (skipped, failed, or forgot) leaves an "unrecorded" line instead,
    which the report refuses: a scenario must not vanish from docs/reliability.md unseen."""
    recorder = ScenarioRecorder(scale, request.node.nodeid)
    yield recorder
    recorder.finish()


@contextlib.contextmanager
def mock_replica_process(itl_ms: int, output_len: int) -> Iterator[str]:
    """The project's mock replica (`tokenyard.bench.mock_replica`) in a process of its
    own, `itl_ms` between tokens and `output_len` tokens a reply: its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenyard.bench.mock_replica", "--port", "0",
         "--itl-ms", str(itl_ms), "--output-len", str(output_len)],
        stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        url = line.split()[-1]
        assert url.startswith("http"), line
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
