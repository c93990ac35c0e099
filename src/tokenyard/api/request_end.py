"""A request's end: its `RequestSummary`, built once from what the request left behind
(its ticket, generations, timeline, route, error code), handed to the observers of
`telemetry.request_log`.

The middleware schedules `request_ended` from its `finally` (with `call_soon`), so every
request ends here once — answered, refused, failed, or cancelled because the client left
(status 499, the code nginx uses for it) — after its last byte went to the socket: the
summary, the log line and the spans cost the response no latency. Nothing is built when
no one observes and nothing is traced. A call that ran without HTTP (a batch line) ends
through `call_ended` (a `CallEnd` says how it ended): the same summary, so the same
record and log line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from types import TracebackType
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
from tokenyard.errors import APIError
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.billing import Usage
from tokenyard.gateway.call import Call, outcome
from tokenyard.gateway.gate import Ticket
from tokenyard.gateway.routing import Route
from tokenyard.telemetry import request_log
from tokenyard.telemetry.request_log import RequestSummary
from tokenyard.telemetry.timeline import Timeline

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
    status = (request.get(STREAM_ERROR_STATUS, response.status) if response is not None
              else CLIENT_CLOSED)
    error_code = request.get(ERROR_CODE)
    if response is None and error_code is None:
        error_code = "client_closed_request"
    return _summary(
        request[REQUEST_ID], request[TIMELINE], request.get(TICKET), request.get(KEY),
        request.get(ROUTE), request.get(GENERATIONS) or (), method=request.method,
        path=request.path, status=status, error_code=error_code, started_at=started_at,
        stream=response is not None and not isinstance(response, web.Response),
        attempts=request.get(ATTEMPTS))


def call_ended(call: Call, *, status: int, error_code: str | None,
               started_at: float, lane: str | None = None) -> None:
    """Publish the summary of a call that ran without HTTP (a batch line, a background
    response: its record and its log line, as a live request's), answered with `status`.
    `lane`: where it came from, as its record says (`request_log.LANES`; None: its
    timeline's, "batch" for a batch line's). Never raises."""
    if not request_log.has_observers():
        return
    try:
        summary = _summary(call.request_id, call.timeline, call.ticket, call.key,
                           call.route, call.gens, method="POST", path=call.endpoint,
                           status=status, error_code=error_code, started_at=started_at,
                           stream=False, attempts=call.attempts,
                           lane=lane)
    except Exception:
        logger.exception("summarizing request %s failed", call.request_id)
        return
    request_log.publish(summary)


@dataclass
class CallEnd:
    """How a call that ran without HTTP (a batch line, a background response) ended,
    published once (`call_ended`) as its `with` block exits, however it exits: until
    the run says otherwise, as cut (499, `error_code`); `publish=False` when it was not
    the call's end (it runs again, or its end is someone else's to publish)."""

    call: Call
    error_code: str | None
    status: int = CLIENT_CLOSED
    publish: bool = True
    started_at: float = field(default_factory=time.time)
    #: The lane its record names (None: its timeline's, `live` or `batch`).
    lane: str | None = None

    def answered(self) -> None:
        self.status, self.error_code = 200, None

    def failed(self, err: APIError, status: int | None = None) -> None:
        """Ended by `err`, answered with `status` (default: the error's own)."""
        self.status = err.status if status is None else status
        self.error_code = err.code or err.type

    def __enter__(self) -> CallEnd:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.publish:
            call_ended(self.call, status=self.status, error_code=self.error_code,
                       started_at=self.started_at, lane=self.lane)


def _summary(
    request_id: str, timeline: Timeline, ticket: Ticket | None, key: KeyContext | None,
    chosen: Route | None, gens: Sequence[Any], *, method: str, path: str, status: int,
    error_code: str | None, started_at: float, stream: bool,
    attempts: Sequence[Any] | None = None, lane: str | None = None,
) -> RequestSummary:
    usage: Usage | None = ticket.usage if ticket is not None else None
    if usage is None and gens:
        usage = outcome(gens)[0]
    cost = None
    if ticket is not None and ticket.cost_micros is not None:
        cost = Decimal(ticket.cost_micros).scaleb(-6).quantize(_MICRO)
    reasons = [reason for gen in gens for reason in gen.finish_reasons if reason]
    received = timeline.events["received"]
    return RequestSummary(
        request_id=request_id,
        started_at=started_at,
        method=method,
        path=path,
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
        stream=stream,
        duration_ms=round((time.perf_counter_ns() - received) / 1e6, 3),
        attempts=tuple(a.to_json() for a in attempts) if attempts is not None else None,
        lane=lane or timeline.lane,
    )
