"""The dashboard's in-memory figures: percentiles from histogram buckets over a window,
and the ring of finished requests with its rates, errors and usage."""

from __future__ import annotations

from decimal import Decimal

import pytest

from tokenyard.telemetry.latency_window import LatencyWindow, bucket_quantile
from tokenyard.telemetry.metrics import TokenyardMetrics
from tokenyard.telemetry.recent_requests import RecentRequests
from tokenyard.telemetry.request_log import RequestSummary

INF = float("inf")
BUCKETS = ((0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (INF, 10.0))


def test_quantiles_interpolate_inside_their_bucket_as_prometheus_does() -> None:
    assert bucket_quantile(BUCKETS, 0.5) == pytest.approx(0.1 + 0.4 * 3 / 4)
    assert bucket_quantile(BUCKETS, 0.99) == pytest.approx(0.5 + 0.5 * 3.9 / 4)
    assert bucket_quantile(BUCKETS, 0.1) == pytest.approx(0.1 * 1 / 2)
    assert bucket_quantile(((1.0, 0.0), (INF, 0.0)), 0.5) is None
    # A rank past the last finite bound answers that bound.
    assert bucket_quantile(((1.0, 1.0), (INF, 4.0)), 0.9) == 1.0


def test_the_window_counts_since_start_until_a_snapshot_is_a_window_old() -> None:
    metrics = TokenyardMetrics()
    window = LatencyWindow(window_s=60, step_s=1)
    for _ in range(3):
        metrics.observe_finished(2.0, 3.0, None, 1, 1, "stop")  # slow, before the window
    first = window.percentiles(metrics.histogram_buckets(), now=0.0)
    assert first["time_to_first_token_seconds"]["count"] == 3
    for _ in range(5):
        metrics.observe_finished(0.03, 0.5, None, 1, 1, "stop")
    later = window.percentiles(metrics.histogram_buckets(), now=30.0)
    assert later["time_to_first_token_seconds"]["count"] == 8  # no snapshot a window old yet
    ttft = "time_to_first_token_seconds"
    recent = window.percentiles(metrics.histogram_buckets(), now=61.0)[ttft]
    assert recent["count"] == 5  # only what finished after the snapshot at t=0
    assert recent["p99"] is not None and 0.02 < recent["p99"] <= 0.05


def summary(i: int, *, status: int = 200, org: str = "org_a", model: str = "m1",
            code: str | None = None, cost: str | None = "0.000010") -> RequestSummary:
    return RequestSummary(
        request_id=f"req_{i}", started_at=1.0e9 + i, method="POST",
        path="/v1/chat/completions", status=status, org_id=org, deployment=model,
        error_code=code, prompt_tokens=10, cached_tokens=4, output_tokens=3,
        cost=None if cost is None else Decimal(cost), timings_ms={"prefill": 1.5},
    )


def test_the_ring_keeps_rates_errors_and_usage_by_org_and_model() -> None:
    ring = RecentRequests(capacity=3)
    for i in range(4):
        ring.observe(summary(i), now=100.0 + i)
    ring.observe(summary(4, status=429, code="rate_limit_exceeded", cost=None), now=104.0)
    ring.observe(summary(5, org="org_b", model="m2"), now=104.5)
    view = ring.to_json(limit=10, now=105.0)
    assert [r["request_id"] for r in view["recent"]] == ["req_5", "req_4", "req_3"]
    assert view["recent"][0]["timings_ms"] == {"prefill": 1.5}
    assert "errors" not in view  # refusals come from the metrics' counter
    assert view["rates"] == {"requests_per_s": 0.6, "errors_per_s": 0.1,
                             "requests_last_minute": 6, "errors_last_minute": 1,
                             "requests_total": 6}
    org_a = view["by_org"][0]
    assert org_a == {"org_id": "org_a", "requests": 5, "prompt_tokens": 50,
                     "cached_tokens": 20, "output_tokens": 15, "cost": "0.000040"}
    assert [row["model"] for row in view["by_model"]] == ["m1", "m2"]
    # A minute later the rates are back to zero; the totals stay.
    quiet = ring.rates(now=170.0)
    assert quiet["requests_per_s"] == 0 and quiet["requests_last_minute"] == 0
    assert quiet["requests_total"] == 6
