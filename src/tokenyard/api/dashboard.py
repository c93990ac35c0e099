"""``GET /admin/v1/dashboard``: the operator dashboard's figures, from memory only.

One JSON object the page at ``/dashboard`` polls every second:

- ``requests``: rates now and over the last minute, tokens and spend by org and by model
  since start, and the last requests with their stage timings — all from this worker's
  `RecentRequests`, a request observer;
- ``refusals``: refused requests by stage, status, code and route, in the last minute
  (``count``) and since start (``total``), from the metrics' refusals counter (every
  worker's, in multiprocess mode) through a `RefusalWindow`;
- ``latency``: TTFT, inter-token and end-to-end percentiles of the last minute, from the
  metrics' histograms (every worker's, in multiprocess mode) through a `LatencyWindow`;
- ``deployments``: each pool's queue and its replicas — health, drain state, load, KV
  cache use and prefix hit rate — from the replica stats the pool's health loop keeps
  (at most a health interval old: no replica is called on a poll);
- ``admissions_open``: rate-limit admissions this worker took and has not settled yet,
  each holding concurrency slots (None without a gateway); 0 once traffic stops;
- ``budgets``: each key's and user's spend budget this worker checked, with its spend
  (this month, in all) and what its requests in flight hold (`gateway/budgets.py`).

Live traffic only, by default: the Batch API's lines (their own `lane` of the latency
histograms, their own ring of recent requests) would otherwise show as live latency
(a batch line waits behind every live request by design). ``?lane=batch`` shows theirs.

No database read feeds it. With several HTTP workers each worker keeps its own ring, so
the ``requests`` figures are those of the worker that answered (``worker_pid``); the
latencies and the refusals are every worker's. Admin scope
required (open when the server runs without authentication).
"""

from __future__ import annotations

import os
import time
from typing import Any

from aiohttp import web

from tokenyard.api.context import KEY, STATE
from tokenyard.api.respond import json_response
from tokenyard.errors import invalid_request
from tokenyard.gateway.auth import require_admin
from tokenyard.gateway.served import Served
from tokenyard.telemetry import request_log
from tokenyard.telemetry.latency_window import LatencyWindow
from tokenyard.telemetry.metrics import LANES
from tokenyard.telemetry.recent_requests import RecentRequests
from tokenyard.telemetry.refusal_window import RefusalWindow

PATH = "/admin/v1/dashboard"
#: The requests the dashboard accounts for.
API_PREFIX = "/v1/"
#: The metrics' histograms the dashboard reports, by their names after the prefix.
LATENCIES = {
    "ttft_s": "time_to_first_token_seconds",
    "inter_token_s": "inter_token_latency_seconds",
    "e2e_s": "e2e_request_latency_seconds",
    "queue_s": "request_queue_time_seconds",
}
#: Per lane (live, batch): its ring of recent requests and its latency window.
_RECENT: web.AppKey[dict[str, RecentRequests]] = web.AppKey("recent_requests", dict)
_WINDOW: web.AppKey[dict[str, LatencyWindow]] = web.AppKey("latency_window", dict)
_REFUSALS: web.AppKey[RefusalWindow] = web.AppKey("refusal_window", RefusalWindow)
_STARTED: web.AppKey[float] = web.AppKey("dashboard_started", float)


def _deployment(served: Served) -> dict[str, Any]:
    pool = served.pool
    return {"name": served.name, "kind": served.kind, "queued": pool.queued,
            "inflight": pool.inflight, "replicas": pool.snapshot()}


def _recent_limit(request: web.Request) -> int:
    """``?recent=N``: how many of the last requests to list (0–200, default 30)."""
    raw = request.query.get("recent", "30")
    if not raw.isdigit() or int(raw) > 200:
        raise invalid_request("recent must be a whole number from 0 to 200.", param="recent")
    return int(raw)


def _lane(request: web.Request) -> str:
    """``?lane=``: whose figures to show (live, the default, or batch)."""
    lane = request.query.get("lane", "live")
    if lane not in LANES:
        raise invalid_request(f"lane must be one of {', '.join(LANES)}.", param="lane")
    return lane


async def dashboard(request: web.Request) -> web.Response:
    """GET /admin/v1/dashboard (see the module)."""
    app = request.app
    state = app[STATE]
    if state.gateway is not None:
        require_admin(request[KEY])
    lane = _lane(request)
    histograms = state.metrics.histogram_buckets(lane)
    window = app[_WINDOW][lane].percentiles(
        {name: histograms[metric] for name, metric in LATENCIES.items() if metric in histograms})
    return json_response({
        "object": "dashboard",
        "worker_pid": os.getpid(),
        "uptime_s": round(time.monotonic() - app[_STARTED], 1),
        "admitting": state.admitting,
        "lane": lane,
        "requests": app[_RECENT][lane].to_json(limit=_recent_limit(request)),
        "latency": window,
        "refusals": app[_REFUSALS].rows(state.metrics.refusals()),
        "deployments": [_deployment(s) for s in state.deployments.values()],
        "admissions_open": None if state.gateway is None else state.gateway.admissions_open,
        "budgets": [] if state.gateway is None else state.gateway.billing.budgets.to_json(),
    })


def add_dashboard_routes(app: web.Application) -> None:
    """Register the endpoint and keep this application's ring of finished requests."""
    recent = app[_RECENT] = {lane: RecentRequests() for lane in LANES}
    app[_WINDOW] = {lane: LatencyWindow() for lane in LANES}
    app[_REFUSALS] = RefusalWindow()
    app[_STARTED] = time.monotonic()

    def api_request(summary: request_log.RequestSummary) -> None:
        # The API's traffic only: not the pages, probes, scrapes or these polls; and
        # the lanes with latency series of their own (a background response has none).
        ring = recent.get(summary.lane)
        if ring is not None and summary.path.startswith(API_PREFIX):
            ring.observe(summary)

    async def observe(app: web.Application) -> None:
        request_log.add_observer(api_request)

    async def forget(app: web.Application) -> None:
        request_log.remove_observer(api_request)

    app.on_startup.append(observe)
    app.on_cleanup.append(forget)
    app.router.add_get(PATH, dashboard)
