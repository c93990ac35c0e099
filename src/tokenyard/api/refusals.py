"""Refusals counted: every request the gateway answers with a 4xx is counted once in
`tokenyard:requests_refused_total` (`telemetry/metrics.py`), by the stage that refused it,
its status, its error code and its route (the route's pattern, so ids never become
labels). The counter lives in prometheus_client, so with `--workers N` it is summed across
the workers like every per-request metric; the dashboard reads it from there.

The middleware knows the stages it runs itself (the edge, authentication); a refusal
raised further on is placed by its status and code (`stage_of`). 5xx answers are failures,
not refusals, and a stream that fails after its 200 is not a refusal either.
"""

from __future__ import annotations

from aiohttp import web

from tokenyard.api.context import STATE
from tokenyard.errors import APIError
from tokenyard.gateway.moderation import CONTENT_POLICY_VIOLATION

#: The route label of a request that matched no route.
UNMATCHED = "unmatched"


def stage_of(err: APIError, stage: str | None = None) -> str | None:
    """The stage that refused with `err` (`stage`: the one the middleware was running when
    it was raised, else None); None for an answer that is not a refusal (not 4xx)."""
    if not 400 <= err.status < 500:
        return None
    if stage is not None:
        return stage
    if err.status == 401:
        return "auth"
    if err.status == 413:
        return "edge"
    if err.code == CONTENT_POLICY_VIOLATION:
        return "moderation"
    if err.status == 403:
        return "authorize"
    if err.status == 402 or err.code == "insufficient_quota":
        return "billing"
    if err.status == 429:
        return "limit"
    return "validation"


def route_of(request: web.Request) -> str:
    """The route's pattern (`/v1/requests/{request_id}`), or UNMATCHED."""
    info = request.match_info.route.resource if request.match_info.route else None
    return info.canonical if info is not None else UNMATCHED


def count_refusal(request: web.Request, err: APIError, stage: str | None = None) -> None:
    """Count `err` in the refusals counter if it is one (see `stage_of`)."""
    found = stage_of(err, stage)
    if found is not None:
        request.app[STATE].metrics.observe_refused(found, err.status, err.code or err.type,
                                                   route_of(request))
