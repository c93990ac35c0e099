"""The Prometheus registry's exposition text and tokenyard's metrics."""

from __future__ import annotations

import pytest

from tokenyard.telemetry.metrics import (
    Counter,
    Gauge,
    Histogram,
    Registry,
    TokenyardMetrics,
    render,
)
from tokenyard.telemetry.timeline import Timeline
from tokenyard.wire.outputs import EngineStats


def test_exposition_text_is_exact_for_a_small_registry() -> None:
    registry = Registry()
    requests = registry.register(Counter("t:requests_total", "Requests.\nAll of them.",
                                         labelnames=("reason",)))
    running = registry.register(Gauge("t:running", "Running now."))
    latency = registry.register(Histogram("t:latency_seconds", "Latency.", [0.1, 1.0]))
    requests.labels(reason="stop").inc()
    requests.labels(reason='say "hi"\\\n').inc(2)
    running.set(3)
    for value in (0.05, 0.1, 0.5, 5.0):
        latency.observe(value)
    assert render(registry) == (
        "# HELP t:requests_total Requests.\\nAll of them.\n"
        "# TYPE t:requests_total counter\n"
        't:requests_total{reason="stop"} 1\n'
        't:requests_total{reason="say \\"hi\\"\\\\\\n"} 2\n'
        "# HELP t:running Running now.\n"
        "# TYPE t:running gauge\n"
        "t:running 3\n"
        "# HELP t:latency_seconds Latency.\n"
        "# TYPE t:latency_seconds histogram\n"
        't:latency_seconds_bucket{le="0.1"} 2\n'
        't:latency_seconds_bucket{le="1.0"} 3\n'
        't:latency_seconds_bucket{le="+Inf"} 4\n'
        "t:latency_seconds_sum 5.65\n"
        "t:latency_seconds_count 4\n"
    )


def test_labelled_histogram_puts_le_after_the_other_labels() -> None:
    registry = Registry()
    hist = registry.register(Histogram("h", "H.", [1.0], labelnames=("route",)))
    hist.labels("chat").observe(2.0)
    assert 'h_bucket{route="chat",le="1.0"} 0\nh_bucket{route="chat",le="+Inf"} 1\n' in (
        render(registry))
    assert 'h_count{route="chat"} 1\n' in render(registry)


def test_counter_rejects_decrements_but_takes_absolute_totals() -> None:
    counter = Counter("c", "C.")
    with pytest.raises(ValueError):
        counter.inc(-1)
    counter.set_total(41)
    counter.inc()
    assert counter.value == 42


def test_labelled_metric_needs_labels_and_names_are_unique() -> None:
    registry = Registry()
    counter = registry.register(Counter("c", "C.", labelnames=("a",)))
    with pytest.raises(ValueError):
        counter.inc()
    with pytest.raises(ValueError):
        counter.labels("x", "y")
    with pytest.raises(ValueError):
        registry.register(Counter("c", "again"))


def test_tokenyard_metrics_follow_engine_stats_and_finished_requests() -> None:
    metrics = TokenyardMetrics()
    metrics.update_from_stats(EngineStats(
        num_running=2, num_waiting=5, kv_cache_usage=0.25, num_kv_blocks=100,
        num_free_kv_blocks=75, prefix_cache_queries=300, prefix_cache_hits=120,
        num_preemptions=1, num_computed_tokens=1000))
    tl = Timeline(received_ns=0)
    tl.mark("queued", now_ns=1_000_000)
    tl.mark("admitted", now_ns=3_000_000)
    tl.mark_token(now_ns=50_000_000)
    metrics.observe_inter_token(tl.mark_token(now_ns=60_000_000))
    tl.mark("done", now_ns=100_000_000)
    metrics.observe_request(tl, num_prompt_tokens=7, num_generation_tokens=2,
                            finished_reasons="stop")
    text = metrics.render()
    for line in [
        "tokenyard:num_requests_running 2",
        "tokenyard:num_requests_waiting 5",
        "tokenyard:kv_cache_usage_perc 0.25",
        "tokenyard:prefix_cache_queries 300",
        "tokenyard:prefix_cache_hits 120",
        "tokenyard:num_preemptions_total 1",
        "tokenyard:prompt_tokens_total 7",
        "tokenyard:generation_tokens_total 2",
        'tokenyard:request_success_total{finished_reason="stop"} 1',
        "tokenyard:time_to_first_token_seconds_sum 0.05",
        "tokenyard:e2e_request_latency_seconds_sum 0.1",
        "tokenyard:request_queue_time_seconds_sum 0.002",
        "tokenyard:inter_token_latency_seconds_count 1",
        'tokenyard:inter_token_latency_seconds_bucket{le="0.01"} 1',
    ]:
        assert line + "\n" in text, line
    for name in ["time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"]:
        assert f"# TYPE tokenyard:{name} histogram\n" in text
