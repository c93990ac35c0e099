"""`tokenyard bench host` at tiny sizes: the null model through the engine alone and through
a real `tokenyard serve` (auth on, one replica), the figures it reports and the tables."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from tokenyard.bench import host_path
from tokenyard.cli.main import main as cli_main
from tokenyard.engine.null_model import FIRST_TEXT_ID, NULL_VOCAB
from tokenyard.wire.sampling_params import SamplingParams


def test_null_model_engine_run_counts_every_token_and_times_decode_steps() -> None:
    llm = host_path.null_llm(8)
    try:
        run = host_path.engine_run(llm, 3, input_len=5, output_len=6, seed=1)
        # A second run of the same engine: its blocks were freed, its outputs are counted
        # from zero again.
        again = host_path.engine_run(llm, 2, input_len=5, output_len=4, seed=2)
        text = llm.generate([[FIRST_TEXT_ID + 3] * 4],
                            SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0))[0]
    finally:
        llm.frontend.core.close()
    assert run.tokens == 3 * 6 and again.tokens == 2 * 4
    # 6 tokens: the first comes with the prefill, the last ends the requests: the steps
    # between are decode steps where every sequence got one.
    assert run.decode_steps == 4 and run.step_us > 0 and run.per_seq_us == run.step_us / 3
    ids = text.completions[0].token_ids
    assert len(ids) == 5 and all(FIRST_TEXT_ID <= t < NULL_VOCAB for t in ids)
    assert len(set(ids)) > 1  # one hot token a position, not one token repeated


def test_served_run_streams_every_token_with_auth_and_cpu_per_process() -> None:
    child, key = host_path.start_server(4)
    try:
        assert key  # auth is on
        run = asyncio.run(host_path.served_run(child, key, 3, input_len=6, output_len=5,
                                               seed=7))
    finally:
        child.stop()
    assert run.failed == 0 and run.tokens == 3 * 5 and run.tok_s > 0
    assert set(run.cpu_us_per_token) == {"gateway", "replica", "client"}
    assert "queue" in run.stages_ms  # the gateway's Server-Timing came through


def test_bench_host_command_writes_tables_and_json(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "host.json"
    code = cli_main(["bench", "host", "--levels", "1,2", "--rounds", "2",
                          "--input-len", "4", "--output-len", "4", "--no-profile",
                          "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| 1 |" in printed and "| 2 |" in printed and "medians of 2" in printed
    figures = json.loads(out.read_text())
    assert [len(figures["engine"][n]) for n in ("1", "2")] == [2, 2]
    assert all(r["tokens"] == 2 * 4 for r in figures["served"]["2"])
    assert len(figures["other_load"]) == 2


def test_render_marks_the_goals_of_one_and_256() -> None:
    args = argparse.Namespace(input_len=4, output_len=4)
    results = host_path.Results(
        engine={n: [host_path.EngineRun(n, 100.0 * n, 90.0, 3, 8 * n, 0.01)]
                for n in (1, 256)},
        served={n: [host_path.ServedRun(n, 400.0, 8 * n, 0, 5.0,
                                        {"gateway": 1.0, "replica": 2.0, "client": 3.0})]
                for n in (1, 256)},
        other_load=[0.1])
    table = host_path.render(results, args)
    assert "<= 1000 µs / step" in table and "<= 30 µs / seq" in table
    # engine 800 tok/s at 1 (8 tokens in 0.01 s), served 400: 50 %
    assert "| 1 | 100 (100-100) | 100.0 (100.0-100.0) |" in table and "50 (50-50) %" in table


def test_the_stage_profile_holds_the_gateways_table() -> None:
    """The gateway runs under ``python -m cProfile`` and writes its statistics when it
    stops: a server's fast exit (`cli.processes.end_process`) leaves that to a profiler."""
    from tokenyard.bench.host_profile import profile_stages

    lines = profile_stages(2, 4, 4, host_path)
    assert any(line.startswith("| engine stage") for line in lines)
    assert any(line.startswith("| gateway stage") for line in lines), lines
