"""`tokenyard bench peers`' table and page section, and the bench client's fixes that
pointing it at llama.cpp's server called for: a request whose pooled connection the server
had closed is sent again on a fresh one; each level of a sweep sends prompts of its own;
failures show in the table. Needs no llama-server: a real aiohttp server here closes each
connection after one response, as llama-server does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import web

from tokenyard.bench import serve as bench_serve
from tokenyard.bench.loadgen import LoadResult, Target, run_load
from tokenyard.bench.peers import (
    PhaseRun,
    engine_pid,
    llama_context,
    medians,
    tokenyard_kv_flags,
)
from tokenyard.bench.peers_table import (
    PAGE_SECTION,
    figures_table,
    ratio,
    render_section,
    requests_table,
    write_section,
)
from tokenyard.bench.proctree import child_pids
from tokenyard.bench.serve import Level, LevelResult, render_table
from tokenyard.bench.stats import RequestRecord, summarize
from tokenyard.bench.workloads import LengthDist, synthetic
from tokenyard.text.model_files import embedded_model_path


class OneResponsePerConnection:
    """A streaming OpenAI chat server that serves one response per connection: a request
    arriving on a connection that already served one finds it closed, unanswered."""

    def __init__(self) -> None:
        self.peers_served: set[Any] = set()
        self.prompts: list[str] = []
        self.closed_unanswered = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peer = request.transport.get_extra_info("peername")
        if peer in self.peers_served:
            self.closed_unanswered += 1
            request.transport.close()
            return web.Response(status=500)  # never reaches the client
        self.peers_served.add(peer)
        body = await request.json()
        self.prompts.append(body["messages"][-1]["content"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 5,
                                          "completion_tokens": body["max_tokens"]}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response


@asynccontextmanager
async def serving(server: OneResponsePerConnection) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


def _load(concurrency: int, requests: int) -> tuple[LoadResult, OneResponsePerConnection]:
    server = OneResponsePerConnection()

    async def go() -> LoadResult:
        async with serving(server) as base:
            workload = synthetic(LengthDist(6), LengthDist(3), seed=1)
            return await run_load(Target(base, "m"), workload, concurrency=concurrency,
                                  max_requests=requests)

    return asyncio.run(go()), server


def test_a_request_on_a_connection_the_server_closed_is_sent_again_on_a_fresh_one() -> None:
    load, server = _load(concurrency=1, requests=6)
    assert server.closed_unanswered >= 1  # the pool did hand out closed connections
    assert [r.error for r in load.records] == [None] * 6
    assert all(r.ok and r.output_tokens == 3 for r in load.records)
    assert load.retried == server.closed_unanswered
    assert len(server.prompts) == 6  # each request answered once


def test_retries_hold_with_streams_in_parallel() -> None:
    load, server = _load(concurrency=4, requests=16)
    assert summarize(load.records, load.duration_s).failed == 0
    assert load.retried == server.closed_unanswered >= 1


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_each_level_of_a_sweep_sends_prompts_of_its_own() -> None:
    server = OneResponsePerConnection()
    args = _args("--concurrency", "1,1", "--requests", "3", "--input-len", "12",
                 "--output-len", "2", "--quiet")

    async def go() -> list[LevelResult]:
        async with serving(server) as base:
            return await bench_serve.run_levels(Target(base, "m"), bench_serve.levels_of(args),
                                                args)

    results = asyncio.run(go())
    assert [r.report.completed for r in results] == [3, 3]
    first, second = server.prompts[:3], server.prompts[3:]
    assert len(first) == len(second) == 3
    assert not set(first) & set(second)


def test_the_serve_table_names_each_levels_failures_and_retries() -> None:
    ok = RequestRecord(0, 0.0, 0.0, ok=True, ttft_s=0.1, e2e_s=0.2, output_tokens=2)
    bad = [RequestRecord(i, 0.0, 0.0, error="http_503", error_detail="busy")
           for i in (1, 2)]
    load = LoadResult([ok, *bad], 1.0, 0.0, concurrency=8, retried=2)
    table = render_table([LevelResult(Level(concurrency=8), load,
                                      summarize(load.records, 1.0))])
    row = next(line for line in table.splitlines() if line.startswith("| c=8"))
    assert "| 2 (http_503 2) |" in row
    assert "sent again on a fresh connection at c=8: 2" in table


# ---------------------------------------------------------------------------- the table


class _Plan:
    short_input, long_input, output, long_output = 45, 1000, 128, 16
    one_stream_requests, requests_8, requests_32, phase_cap_s = 3, 16, 64, 120.0


def _rounds() -> list[dict[str, dict[str, PhaseRun]]]:
    def run(decode: float, ttft: float, failed: int = 0) -> dict[str, PhaseRun]:
        return {"one stream": PhaseRun({"decode_tok_s": decode, "ttft_short_ms": ttft},
                                       sent=3, failed=failed, retried=1,
                                       failures={"http_503": f"{failed}× busy"} if failed
                                       else {})}
    return [{"llama-server": run(100.0, 60.0), "tokenyard": run(25.0, 30.0)},
            {"tokenyard": run(20.0, 40.0, failed=1), "llama-server": run(110.0, 70.0)},
            {"llama-server": run(90.0, 80.0), "tokenyard": run(30.0, 35.0)}]


def test_medians_ranges_and_ratios_side_by_side() -> None:
    rounds = _rounds()
    values = {s: medians(rounds, s) for s in ("llama-server", "tokenyard")}
    assert values["tokenyard"]["decode_tok_s"] == [25.0, 20.0, 30.0]
    table = figures_table(values, _Plan(), rounds)
    decode = next(line for line in table.splitlines() if "decode tok/s" in line)
    # min / median / max per server; the ratio of the medians, then of each round's pair
    # (25/100, 20/110, 30/90).
    assert decode == ("| one stream, decode tok/s | 90.0 / **100** / 110 | "
                      "20.0 / **25.0** / 30.0 | 0.25 (llama better); rounds 0.18–0.33 |")
    ttft = next(line for line in table.splitlines() if "~45-token" in line)
    assert ttft.endswith("| 30.0 / **35.0** / 40.0 | 0.50 (tokenyard better); "
                         "rounds 0.44–0.57 |")
    assert "| TTFT p99, 32 concurrent, ms | - | - | - |" in table  # not measured
    # Without the rounds, no per-round range; one value is the median alone.
    assert figures_table(values, _Plan()).count("rounds ") == 0
    one = {s: medians(rounds[:1], s) for s in ("llama-server", "tokenyard")}
    assert "| 100 | 25.0 | 0.25 (llama better) |" in figures_table(one, _Plan(), rounds[:1])


def test_ratio_direction_follows_what_is_better() -> None:
    assert ratio([200.0], [100.0], higher_better=True) == "2.00 (tokenyard better)"
    assert ratio([200.0], [100.0], higher_better=False) == "2.00 (llama better)"
    assert ratio([], [100.0], higher_better=True) == "-"


def test_requests_table_counts_every_round_and_lists_failures() -> None:
    table = requests_table(_rounds())
    assert "| one stream | 9 / 0 / 3 | 9 / 1 / 3 |" in table
    assert "- tokenyard, one stream, round 2: http_503: 1× busy" in table


def _section(marker: str, min_rounds: int = 3) -> str:
    rounds = _rounds()
    setup: dict[str, Any] = {
        "plan": _Plan(), "build_s": 0.0, "machine": "cpu", "date": marker, "rounds": 3,
        "min_rounds": min_rounds,
        "measured_s": 600.0, "command": "tokenyard bench peers", "model": "m.gguf",
        "llama": "llama-server", "tokenyard": "tokenyard serve"}
    return render_section({s: medians(rounds, s) for s in ("llama-server", "tokenyard")},
                          rounds, setup)


def test_a_run_short_of_the_minimum_rounds_says_so() -> None:
    assert "**Only 3 rounds** (fewer than 5)" in _section("d", min_rounds=5)
    assert "**Only" not in _section("d", min_rounds=3)


def test_the_default_is_at_least_five_rounds() -> None:
    from tokenyard.bench import peers
    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    args = parser.parse_args([])
    assert args.rounds is None and args.model == "embedded"  # the plan's rounds, then
    assert peers.Plan().rounds == peers.MIN_ROUNDS >= 5


def test_the_section_is_appended_then_replaced_and_the_rest_kept(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n## Engine\n\nengine table\n\n## Profile\n\nby hand\n")
    write_section(page, _section("first"))
    text = page.read_text()
    assert text.index("## Profile") < text.index(PAGE_SECTION)
    assert "by hand" in text and "date: first" in text
    page.write_text(page.read_text() + "\n## Later\n\nkept\n")
    write_section(page, _section("second"))
    text = page.read_text()
    assert text.count(PAGE_SECTION) == 1
    assert "date: first" not in text and "date: second" in text
    assert text.endswith("## Later\n\nkept\n") and "engine table" in text


def test_tokenyard_gets_llama_servers_kv_cache() -> None:
    """float16 elements, and the bytes llama-server's 32-slot context takes (SmolLM2-135M:
    30 layers x 2 x 3 kv heads x 64 x 2 bytes = 23,040 bytes a token)."""
    flags = tokenyard_kv_flags(embedded_model_path())
    assert flags[:2] == ["--kv-cache-dtype", "float16"]
    assert float(flags[3]) == round(23_040 * llama_context(32) / 2**30, 4)


def test_the_model_process_is_the_engine_child_else_the_server() -> None:
    sleeper = "import time; time.sleep(30)"
    spawn = ("import subprocess, sys, time; "
             f"subprocess.Popen([sys.executable, '-c', {sleeper!r}, 'engine']); "
             "time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", spawn])
    alone = subprocess.Popen([sys.executable, "-c", sleeper])
    children: list[int] = []
    try:
        deadline = time.monotonic() + 10
        while not children and time.monotonic() < deadline:
            children = child_pids(parent.pid)
            time.sleep(0.05)
        assert len(children) == 1
        assert engine_pid(parent.pid) == children[0]
        assert engine_pid(alone.pid) == alone.pid
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        for p in (parent, alone):
            p.kill()
            p.wait()
