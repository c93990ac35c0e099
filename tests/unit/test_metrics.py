"""tokenyard's metrics through prometheus_client: names, help texts and values on the page,
the engine's figures as the replica reports them, and multiprocess mode summing workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenyard.telemetry.metrics import (
    MULTIPROC_DIR_ENV,
    TokenyardMetrics,
    mark_worker_dead,
    render_engine_stats,
)
from tokenyard.telemetry.timeline import Timeline
from tokenyard.wire.outputs import EngineStats

STATS = EngineStats(
    num_running=2, num_waiting=5, kv_cache_usage=0.25, num_kv_blocks=100,
    num_free_kv_blocks=75, prefix_cache_queries=300, prefix_cache_hits=120,
    num_preemptions=1, num_computed_tokens=1000)


def samples(text: str) -> dict[str, float]:
    """The samples of a Prometheus text page, by series (name and labels)."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_tokenyard_metrics_follow_engine_stats_and_finished_requests() -> None:
    metrics = TokenyardMetrics()
    metrics.update_from_stats(STATS)
    tl = Timeline(received_ns=0)
    tl.mark("queued", now_ns=1_000_000)
    tl.mark("admitted", now_ns=3_000_000)
    tl.mark_token(now_ns=50_000_000)
    metrics.observe_inter_token(tl.mark_token(now_ns=60_000_000))
    metrics.observe_inter_token(None)
    tl.mark("done", now_ns=100_000_000)
    metrics.observe_request(tl, num_prompt_tokens=7, num_generation_tokens=2,
                            finished_reasons="stop")
    metrics.observe_finished(None, 0.5, None, 3, 4, ["stop", "length"])
    text = metrics.render()
    got = samples(text)
    for series, value in {
        "tokenyard:num_requests_running": 2,
        "tokenyard:num_requests_waiting": 5,
        "tokenyard:kv_cache_usage_perc": 0.25,
        "tokenyard:prefix_cache_queries": 300,
        "tokenyard:prefix_cache_hits": 120,
        "tokenyard:num_preemptions_total": 1,
        "tokenyard:prompt_tokens_total": 10,
        "tokenyard:generation_tokens_total": 6,
        'tokenyard:request_success_total{finished_reason="stop"}': 2,
        'tokenyard:request_success_total{finished_reason="length"}': 1,
        'tokenyard:time_to_first_token_seconds_sum{lane="live"}': 0.05,
        'tokenyard:time_to_first_token_seconds_count{lane="live"}': 1,
        'tokenyard:e2e_request_latency_seconds_sum{lane="live"}': 0.6,
        'tokenyard:e2e_request_latency_seconds_count{lane="live"}': 2,
        'tokenyard:request_queue_time_seconds_sum{lane="live"}': 0.002,
        'tokenyard:inter_token_latency_seconds_count{lane="live"}': 1,
        'tokenyard:inter_token_latency_seconds_bucket{lane="live",le="0.005"}': 0,
        'tokenyard:inter_token_latency_seconds_bucket{lane="live",le="0.01"}': 1,
        'tokenyard:inter_token_latency_seconds_bucket{lane="live",le="+Inf"}': 1,
        'tokenyard:e2e_request_latency_seconds_bucket{lane="live",le="0.1"}': 1,
        'tokenyard:e2e_request_latency_seconds_bucket{lane="live",le="0.5"}': 2,
        "tokenyard:http_workers": 1,
    }.items():
        assert got.get(series) == pytest.approx(value), series
    # Every name, type and help text of the page before prometheus_client, unchanged.
    for name, kind, doc in [
        ("time_to_first_token_seconds", "histogram", "Time to first token in seconds."),
        ("inter_token_latency_seconds", "histogram",
         "Time between consecutive token arrivals in seconds."),
        ("e2e_request_latency_seconds", "histogram", "End-to-end request latency in seconds."),
        ("request_queue_time_seconds", "histogram",
         "Time requests spent waiting in the queue in seconds."),
        ("num_requests_running", "gauge", "Requests in the engine's running batch."),
        ("num_requests_waiting", "gauge", "Requests waiting to be admitted."),
        ("kv_cache_usage_perc", "gauge", "KV-cache usage; 1 means 100 percent."),
        ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."),
        ("prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache."),
        ("prompt_tokens_total", "counter", "Prompt tokens of finished requests."),
        ("generation_tokens_total", "counter", "Generated tokens of finished requests."),
        ("request_success_total", "counter", "Finished requests by finish reason."),
        ("num_preemptions_total", "counter", "Requests preempted by the scheduler."),
    ]:
        assert f"# HELP tokenyard:{name} {doc}\n# TYPE tokenyard:{name} {kind}\n" in text, name
    assert "_created" not in text


def test_a_batch_line_moves_only_the_batch_lane_of_the_latencies() -> None:
    """Batch lines wait behind every live request by design: their latencies go to the
    `lane="batch"` series and never move the live ones (nor the dashboard's figures)."""
    metrics = TokenyardMetrics()
    line = Timeline(received_ns=0, lane="batch")
    line.mark("queued", now_ns=1_000_000)
    line.mark("admitted", now_ns=40_000_000_000)
    line.mark_token(now_ns=49_000_000_000)
    metrics.observe_inter_token(line.mark_token(now_ns=50_000_000_000), line.lane)
    line.mark("done", now_ns=575_000_000_000)
    metrics.observe_request(line, num_prompt_tokens=7, num_generation_tokens=2,
                            finished_reasons="stop")
    got = samples(metrics.render())
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "inter_token_latency_seconds"):
        assert got[f'tokenyard:{name}_count{{lane="live"}}'] == 0, name
        assert got[f'tokenyard:{name}_count{{lane="batch"}}'] == 1, name
    assert all(count == 0 for buckets in metrics.histogram_buckets("live").values()
               for _, count in buckets)
    assert metrics.histogram_buckets("batch")["time_to_first_token_seconds"][-1][1] == 1


def test_engine_figures_are_the_snapshot_as_is() -> None:
    assert render_engine_stats(STATS).splitlines()[-15:] == [
        "# HELP tokenyard:prefix_cache_hits Prompt tokens served from the prefix cache.",
        "# TYPE tokenyard:prefix_cache_hits counter",
        "tokenyard:prefix_cache_hits 120",
        "# HELP tokenyard:num_preemptions_total Requests preempted by the scheduler.",
        "# TYPE tokenyard:num_preemptions_total counter",
        "tokenyard:num_preemptions_total 1",
        "# HELP tokenyard:num_overlapped_steps_total Engine steps planned while the step "
        "before still computed (async scheduling).",
        "# TYPE tokenyard:num_overlapped_steps_total counter",
        "tokenyard:num_overlapped_steps_total 0",
        "# HELP tokenyard:spec_decode_num_draft_tokens_total Draft tokens verified by "
        "speculative decoding.",
        "# TYPE tokenyard:spec_decode_num_draft_tokens_total counter",
        "tokenyard:spec_decode_num_draft_tokens_total 0",
        "# HELP tokenyard:spec_decode_num_accepted_tokens_total Draft tokens speculative "
        "decoding accepted.",
        "# TYPE tokenyard:spec_decode_num_accepted_tokens_total counter",
        "tokenyard:spec_decode_num_accepted_tokens_total 0",
    ]
    # A replica that restarted reports smaller totals: shown as they are (a counter reset).
    later = TokenyardMetrics()
    later.update_from_stats(STATS)
    later.update_from_stats(EngineStats(
        num_running=0, num_waiting=0, kv_cache_usage=0.0, num_kv_blocks=100,
        num_free_kv_blocks=100, prefix_cache_queries=3, prefix_cache_hits=0,
        num_preemptions=0, num_computed_tokens=0))
    assert samples(later.render())["tokenyard:prefix_cache_queries"] == 3


_WORKER = """
import sys
from tokenyard.telemetry.metrics import TokenyardMetrics
m = TokenyardMetrics()
n = int(sys.argv[1])
for _ in range(n):
    m.observe_finished(0.01, 0.2, None, 5, 3, "stop")
print("done", flush=True)
"""


def test_multiprocess_mode_sums_every_worker_and_counts_live_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two worker processes write their own files; a page rendered anywhere sums them.
    env = {**os.environ, MULTIPROC_DIR_ENV: str(tmp_path)}
    procs = [subprocess.run([sys.executable, "-c", _WORKER, str(n)], env=env, check=True,
                            capture_output=True, text=True, timeout=60) for n in (2, 3)]
    assert all(p.stdout.strip() == "done" for p in procs)
    files = sorted(f.name for f in tmp_path.iterdir())
    pids = sorted({int(name.rsplit("_", 1)[1].split(".")[0]) for name in files})
    assert len(pids) == 2, files
    monkeypatch.setenv(MULTIPROC_DIR_ENV, str(tmp_path))
    page = TokenyardMetrics()  # this process is not in multiprocess mode: it only reads
    got = samples(page.render())
    assert got["tokenyard:prompt_tokens_total"] == 25
    assert got["tokenyard:generation_tokens_total"] == 15
    assert got['tokenyard:request_success_total{finished_reason="stop"}'] == 5
    assert got['tokenyard:e2e_request_latency_seconds_count{lane="live"}'] == 5
    assert got['tokenyard:e2e_request_latency_seconds_bucket{lane="live",le="0.1"}'] == 0
    assert got['tokenyard:e2e_request_latency_seconds_bucket{lane="live",le="0.25"}'] == 5
    assert got["tokenyard:http_workers"] == 2
    # A dead worker's live gauge goes; its counts stay in the sums.
    mark_worker_dead(pids[0], str(tmp_path))
    got = samples(page.render())
    assert got["tokenyard:http_workers"] == 1
    assert got["tokenyard:prompt_tokens_total"] == 25
