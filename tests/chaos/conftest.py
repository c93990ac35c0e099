"""The chaos suite's two fixtures: `scale` (how hard a scenario pushes) and `record`
(what it sent and what held, one JSON line each, for tests/chaos/report.py).

`TOKENYARD_CHAOS=full` selects the full scale (`make chaos`); anything else the short
one that `make test` runs. `TOKENYARD_CHAOS_RESULTS` names the JSON-lines file the
records go to; unset, recording is a no-op so a plain pytest run writes nothing.
"""

from __future__ import annotations

import json
import os
import time
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


def append_record(path: Path, scenario: str, *, command: str,
                  sent: dict[str, int | float | str], held: dict[str, Figure],
                  scale: Scale) -> None:
    """Append one scenario's outcome to `path` as a JSON line."""
    line = {"scenario": scenario, "command": command, "scale": scale, "sent": sent,
            "held": held, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(line, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def scale() -> Scale:
    """How hard the scenarios push: "short" (make test) or "full" (make chaos)."""
    return chaos_scale()


@pytest.fixture
def record(scale: Scale) -> Recorder:
    """`record(scenario, command=..., sent=..., held=...)`: one line in the results file
    named by TOKENYARD_CHAOS_RESULTS; nothing when it is unset."""
    def _record(scenario: str, *, command: str, sent: dict[str, int | float | str],
                held: dict[str, Figure]) -> None:
        target = os.environ.get("TOKENYARD_CHAOS_RESULTS", "").strip()
        if target:
            append_record(Path(target), scenario, command=command, sent=sent, held=held,
                          scale=scale)

    return _record
