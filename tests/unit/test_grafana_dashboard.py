"""The Grafana dashboard in docs/ queries only metrics that `/metrics` really writes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from tokenyard.telemetry.metrics import PREFIX, TokenyardMetrics
from tokenyard.wire.outputs import EngineStats

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "tokenyard.json"
_NAME = re.compile(re.escape(PREFIX) + r"[a-z_]+")
_SAMPLE = re.compile(r"^(" + re.escape(PREFIX) + r"[a-z_]+)", re.MULTILINE)


def _page() -> str:
    metrics = TokenyardMetrics(CollectorRegistry())
    metrics.observe_finished(0.1, 1.0, 0.01, 10, 5, "stop")
    metrics.observe_inter_token(20_000_000)
    metrics.observe_refused("limit", 429, "rate_limit_exceeded", "/v1/chat/completions")
    metrics.update_from_stats(EngineStats(
        num_running=1, num_waiting=0, kv_cache_usage=0.5, num_kv_blocks=10,
        num_free_kv_blocks=5, prefix_cache_queries=10, prefix_cache_hits=4,
        num_preemptions=0, num_computed_tokens=15))
    return metrics.render()


def test_every_queried_series_is_on_the_metrics_page() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs, "the dashboard has no queries"
    written = set(_SAMPLE.findall(_page()))
    queried = {name for expr in exprs for name in _NAME.findall(expr)}
    missing = sorted(queried - written)
    assert not missing, f"the dashboard queries series /metrics never writes: {missing}"
    # and each panel's datasource is the import-time input, so the file imports anywhere
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dashboard["panels"])


def test_panel_ids_and_positions_are_unique() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels}
    assert len(cells) == len(panels)
