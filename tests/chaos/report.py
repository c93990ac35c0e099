"""Render the chaos suite's results (JSON lines from `record`) as docs/reliability.md.

    python -m tests.chaos.report RESULTS.jsonl > docs/reliability.md

One section per scenario, in the order they first ran: the command that reproduces it,
what was sent and what held. A scenario recorded twice (a rerun) shows its last record.
A test that asked for `record` and wrote nothing (it skipped or failed) is listed at the
top and makes the exit status 1, so that `make chaos` fails instead of dropping a section.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INTRO = """# Reliability

What `make chaos` (`tests/chaos` at full scale, then `python -m tests.chaos.report`)
found; regenerate it with `make chaos` rather than editing it. Each scenario below ran
against a real `tokenyard serve` on 127.0.0.1, and sent traffic nowhere else. Every one
ends with the quiescence check, whose figures are in its table:

- nothing running or waiting on any replica and no KV block in use, no request in flight
  or queued at any pool and no concurrency admission open once traffic stops;
- the HTTP process's resident memory under its bound.

Throughout, no answer is a 5xx other than the documented 503 (overloaded, unavailable)
and 529. The scenarios whose tables show `ledger_*` figures also check that every
request that produced tokens is in the ledger exactly once; the disconnect storm bills a
prepaid org and checks that its balance equals its credit minus its ledger. The money
scenarios (two gateways holding a key's budget in Redis; one killed, or Redis restarted
empty) check that no more than the budget was spent and that Redis's running spend
equals the ledger's; docs/operations.md ("Money across gateways") gives the bounds when
Redis loses its keys or a gateway dies holding money. `make test` runs a short version
of each.
"""


@dataclass
class Results:
    """What a results file holds: each scenario's last record, in order of first
    appearance, and the tests whose last run recorded nothing."""

    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    unrecorded: list[str] = field(default_factory=list)
    started: str | None = None  # UTC time of the run's start, as written
    ended: str | None = None
    seconds: float | None = None  # the run's length, from its end line
    exitstatus: int | None = None


def load(path: Path) -> Results:
    """Read a results file written by tests/chaos/conftest.py."""
    results = Results()
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        if entry.get("run") == "start":
            results.started, results.ended, results.seconds = entry["at"], None, None
        elif entry.get("run") == "end":
            results.ended, results.seconds = entry["at"], entry["seconds"]
            results.exitstatus = entry.get("exitstatus")
        elif "unrecorded" in entry:
            results.unrecorded.append(entry["unrecorded"])
        elif "scenario" in entry:
            results.records[entry["scenario"]] = entry
            # A rerun that recorded makes up for an earlier run that did not.
            results.unrecorded = [t for t in results.unrecorded if t != entry.get("test")]
    return results


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


def run_time(results: Results) -> str:
    """One line on how long the run took, from its start and end lines."""
    if results.seconds is None:
        return f"Run started {results.started or '?'}; its end was not recorded."
    minutes, seconds = divmod(round(results.seconds), 60)
    status = "" if results.exitstatus in (0, None) else f", pytest exit status {results.exitstatus}"
    return (f"Total run time: {minutes} min {seconds} s (from {results.started} to "
            f"{results.ended}{status}).")


def render(results: Results) -> str:
    """The whole document: the intro and the run time, the tests that recorded nothing,
    then a section per scenario."""
    lines = [INTRO, run_time(results), ""]
    if results.unrecorded:
        lines += ["## Not recorded", "",
                  "These tests wrote no record (skipped or failed): this report is incomplete.",
                  "", *(f"- `{test}`" for test in results.unrecorded), ""]
    for name, entry in results.records.items():
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
    results = load(Path(argv[0]))
    sys.stdout.write(render(results))
    if results.unrecorded:
        print("no record from: " + ", ".join(results.unrecorded), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
