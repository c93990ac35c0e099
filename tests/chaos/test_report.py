"""The harness itself: `record` writes what `report` renders, and only when asked; a test
that recorded nothing makes the report fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.conftest import (
    Recorder,
    ScenarioRecorder,
    append_line,
    append_record,
    chaos_scale,
)
from tests.chaos.report import load, main, render


def test_records_render_one_section_per_scenario_last_record_wins(tmp_path: Path) -> None:
    results = tmp_path / "r.jsonl"
    append_record(results, "slowloris", command="pytest -k a", sent={"connections": 5},
                  held={"served": True}, scale="short")
    append_record(results, "fuzz", command="pytest -k b", sent={"cases": 3},
                  held={"5xx": 0}, scale="full")
    append_record(results, "slowloris", command="pytest -k a", sent={"connections": 50},
                  held={"served": False}, scale="full")
    doc = render(load(results))
    assert doc.startswith("# Reliability")
    assert doc.count("## slowloris") == 1 and doc.index("## slowloris") < doc.index("## fuzz")
    assert "| connections | 50 |" in doc and "| connections | 5 |" not in doc
    assert "| served | no |" in doc and "| 5xx | 0 |" in doc


def test_scale_is_full_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENYARD_CHAOS", raising=False)
    assert chaos_scale() == "short"
    monkeypatch.setenv("TOKENYARD_CHAOS", "full")
    assert chaos_scale() == "full"


def test_record_is_a_no_op_without_a_results_file(
        record: Recorder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TOKENYARD_CHAOS_RESULTS", raising=False)
    record("x", command="c", sent={}, held={})
    assert list(tmp_path.iterdir()) == []


def test_a_test_that_recorded_nothing_fails_the_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    results = tmp_path / "r.jsonl"
    monkeypatch.setenv("TOKENYARD_CHAOS_RESULTS", str(results))
    recorded = ScenarioRecorder("short", "tests/chaos/test_a.py::test_ran")
    recorded("ran", command="c", sent={}, held={"ok": True})
    recorded.finish()
    ScenarioRecorder("short", "tests/chaos/test_b.py::test_skipped").finish()
    assert main([str(results)]) == 1
    out, err = capsys.readouterr()
    assert "## Not recorded" in out and "`tests/chaos/test_b.py::test_skipped`" in out
    assert "## ran" in out and "test_a.py" not in out
    assert "test_skipped" in err


def test_a_rerun_that_recorded_makes_up_for_one_that_did_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "r.jsonl"
    monkeypatch.setenv("TOKENYARD_CHAOS_RESULTS", str(results))
    ScenarioRecorder("short", "t::flaky").finish()
    rerun = ScenarioRecorder("short", "t::flaky")
    rerun("flaky", command="c", sent={}, held={})
    rerun.finish()
    assert load(results).unrecorded == []
    assert main([str(results)]) == 0


def test_the_report_states_the_total_run_time(tmp_path: Path) -> None:
    results = tmp_path / "r.jsonl"
    append_line(results, {"run": "start"})
    append_record(results, "fuzz", command="c", sent={}, held={}, scale="full")
    append_line(results, {"run": "end", "exitstatus": 0, "seconds": 604.2})
    assert "Total run time: 10 min 4 s (from 20" in render(load(results))
    (tmp_path / "cut.jsonl").write_text(results.read_text().splitlines()[0] + "\n")
    assert "its end was not recorded" in render(load(tmp_path / "cut.jsonl"))
