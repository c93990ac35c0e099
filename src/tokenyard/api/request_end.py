"""A request's end: its `RequestSummary`, built once from what the request left behind
(its ticket, generations, timeline, route, error code), handed to the observers of
`telemetry.request_log`.

The middleware schedules `request_ended` from its `finally` (with `call_soon`), so every
request ends here once — answered, refused, failed, or cancelled because the client left
(status 499, the code nginx uses for it) — after its last byte went to the socket: the
summary, the log line and the spans cost the response no latency. Nothing is built when
no one observes and nothing is traced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from aiohttp import web

from tokenyard.api.context import (
    ATTEMPTS,
    ERROR_CODE,
    GENERATIONS,
    KEY,
    REQUEST_ID,
    ROUTE,
    STREAM_ERROR_STATUS,
    TICKET,
    TIMELINE,
    TRACE,
)
from tokenyard.api.request_trace import trace_request
from tokenyard.gateway.billing import Usage
from tokenyard.gateway.call import outcome
from tokenyard.telemetry import request_log
from tokenyard.telemetry.request_log import RequestSummary

logger = logging.getLogger("tokenyard.api")

_MICRO = Decimal("0.000001")
#: The status of a request whose client went away before its response ended.
CLIENT_CLOSED = 499


def request_ended(
    request: web.Request, response: web.StreamResponse | None, started_at: float
) -> None:
    """Publish the request's summary and export its spans (no-op without observers or
    traces). Never raises: it runs in the middleware's `finally`, where an error would
    replace the response."""
    ids = request.get(TRACE)
    if ids is None and not request_log.has_observers():
        return
    try:
        summary = summarize(request, response, started_at)
    except Exception:
        logger.exception("summarizing request %s failed", request.get(REQUEST_ID))
        return
    request_log.publish(summary)
    if ids is not None:
        try:
            trace_request(request, summary, ids)
        except Exception:
            logger.exception("exporting the spans of %s failed", summary.request_id)


def summarize(
    request: web.Request, response: web.StreamResponse | None, started_at: float
) -> RequestSummary:
    """The summary of a request that ended with `response` (None: cancelled)."""
    timeline = request[TIMELINE]
    ticket, key, chosen = request.get(TICKET), request.get(KEY), request.get(ROUTE)
    gens: Sequence[Any] = request.get(GENERATIONS) or ()
    usage: Usage | None = ticket.usage if ticket is not None else None
    if usage is None and gens:
        usage = outcome(gens)[0]
    status = (request.get(STREAM_ERROR_STATUS, response.status) if response is not None
              else CLIENT_CLOSED)
    error_code = request.get(ERROR_CODE)
    if response is None and error_code is None:
        error_code = "client_closed_request"
    cost = None
    if ticket is not None and ticket.cost_micros is not None:
        cost = Decimal(ticket.cost_micros).scaleb(-6).quantize(_MICRO)
    reasons = [reason for gen in gens for reason in gen.finish_reasons if reason]
    received = timeline.events["received"]
    return RequestSummary(
        request_id=request[REQUEST_ID],
        started_at=started_at,
        method=request.method,
        path=request.path,
        status=status,
        key_prefix=key.prefix if key is not None else None,
        org_id=key.org_id if key is not None else None,
        project_id=key.project_id if key is not None else None,
        user_id=key.user_id if key is not None else None,
        model=(chosen.alias or chosen.deployment) if chosen is not None else None,
        deployment=chosen.deployment if chosen is not None else None,
        replica=timeline.replica,
        region=chosen.region if chosen is not None else None,
        error_code=error_code,
        finish_reason=",".join(reasons) or None,
        prompt_tokens=usage.prompt_tokens if usage is not None else 0,
        cached_tokens=usage.cached_tokens if usage is not None else 0,
        output_tokens=usage.output_tokens if usage is not None else 0,
        cost=cost,
        timings_ms=timeline.timings_ms(),
        stream=response is not None and not isinstance(response, web.Response),
        duration_ms=round((time.perf_counter_ns() - received) / 1e6, 3),
        attempts=tuple(a.to_json() for a in request[ATTEMPTS]) if ATTEMPTS in request
        else None,
    )
