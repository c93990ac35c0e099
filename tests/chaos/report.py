"""Render the chaos suite's results (JSON lines from `record`) as docs/reliability.md.

    python -m tests.chaos.report RESULTS.jsonl > docs/reliability.md

One section per scenario, in the order they first ran: the command that reproduces it,
what was sent and what held. A scenario recorded twice (a rerun) shows its last record.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

INTRO = """# Reliability

What `make chaos` (`tests/chaos` at full scale, then `python -m tests.chaos.report`)
found; regenerate it with `make chaos` rather than editing it. Each scenario below ran
against a real `tokenyard serve` on 127.0.0.1 (or in a network namespace the suite
creates). Every one ends with the quiescence check, whose figures are in its table:

- nothing running or waiting on any replica and no KV block in use, no request in flight
  or queued at any pool and no concurrency admission open once traffic stops;
- the HTTP process's resident memory under its bound.

Throughout, no answer is a 5xx other than the documented 503 (overloaded, unavailable)
and 529. The scenarios that bill also check that every request that produced tokens is
in the ledger exactly once and that balances equal credit minus ledger (their `ledger_*`
and balance figures). `make test` runs a short version of each.
"""


def load(path: Path) -> dict[str, dict[str, Any]]:
    """The last record of each scenario, in order of first appearance."""
    records: dict[str, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            entry = json.loads(line)
            records[entry["scenario"]] = entry
    return records


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value).replace("|", "\\|")


def _table(figures: dict[str, Any]) -> list[str]:
    if not figures:
        return ["(none)", ""]
    rows = ["| figure | value |", "|---|---|"]
    rows += [f"| {name} | {_value(value)} |" for name, value in figures.items()]
    return [*rows, ""]


def render(records: dict[str, dict[str, Any]]) -> str:
    """The whole document: the intro, then a section per scenario."""
    lines = [INTRO]
    for name, entry in records.items():
        ran = f"Scale: {entry.get('scale', '?')}, run {entry.get('at', '?')}."
        lines += [f"## {name}", "", ran, "", "```", entry["command"], "```", "", "Sent:", ""]
        lines += _table(entry.get("sent", {}))
        lines += ["Held:", ""]
        lines += _table(entry.get("held", {}))
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.chaos.report RESULTS.jsonl", file=sys.stderr)
        return 2
    sys.stdout.write(render(load(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
