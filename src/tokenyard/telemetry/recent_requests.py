"""What the operator dashboard shows of finished requests, kept in memory.

`RecentRequests` is fed by a request observer (`telemetry/request_log.py`): it keeps the last
`capacity` summaries (a bounded ring), the arrivals of the last minute for the request
and error rates, and tokens and spend by org and by model since this process started
(refusals by reason come from the metrics' counter instead, summed across workers:
`refusal_window.py`). Everything is updated in O(1) per request on the event loop
and read by the dashboard's endpoint; nothing is written anywhere, so a restart starts
from zero. With several HTTP workers each worker has its own (the endpoint answers
with the figures of the worker that served the poll).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from tokenyard.telemetry.request_log import RequestSummary

#: Seconds of arrivals kept for the rates.
RATE_WINDOW_S = 60
#: The span the "now" rates average over, in seconds.
RATE_SPAN_S = 10


@dataclass
class UsageTotals:
    """Requests, tokens and spend of one org or one model."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    cost: Decimal = Decimal(0)

    def add(self, summary: RequestSummary) -> None:
        self.requests += 1
        self.prompt_tokens += summary.prompt_tokens
        self.cached_tokens += summary.cached_tokens
        self.output_tokens += summary.output_tokens
        if summary.cost is not None:
            self.cost += summary.cost

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "output_tokens": self.output_tokens,
                "cost": str(self.cost)}


class RecentRequests:
    """The dashboard's in-memory account of finished requests (see the module)."""

    def __init__(self, capacity: int = 200) -> None:
        self.recent: deque[RequestSummary] = deque(maxlen=capacity)
        #: (second, requests, errors), oldest first, one entry per second with arrivals.
        self._seconds: deque[list[int]] = deque()
        self.by_org: dict[str, UsageTotals] = {}
        self.by_model: dict[str, UsageTotals] = {}
        self.total = 0

    def observe(self, summary: RequestSummary, now: float | None = None) -> None:
        self.recent.append(summary)
        self.total += 1
        second = int(time.monotonic() if now is None else now)
        failed = summary.status >= 400
        if self._seconds and self._seconds[-1][0] == second:
            self._seconds[-1][1] += 1
            self._seconds[-1][2] += failed
        else:
            self._seconds.append([second, 1, int(failed)])
            while self._seconds[0][0] <= second - RATE_WINDOW_S:
                self._seconds.popleft()
        if summary.org_id is not None:
            self.by_org.setdefault(summary.org_id, UsageTotals()).add(summary)
        model = summary.deployment or summary.model
        if model is not None:
            self.by_model.setdefault(model, UsageTotals()).add(summary)

    def rates(self, now: float | None = None) -> dict[str, float | int]:
        """Requests and errors per second over the last `RATE_SPAN_S`, and the counts of
        the last minute."""
        second = int(time.monotonic() if now is None else now)
        recent = [s for s in self._seconds if s[0] > second - RATE_WINDOW_S]
        span = [s for s in recent if s[0] > second - RATE_SPAN_S]
        return {
            "requests_per_s": round(sum(s[1] for s in span) / RATE_SPAN_S, 3),
            "errors_per_s": round(sum(s[2] for s in span) / RATE_SPAN_S, 3),
            "requests_last_minute": sum(s[1] for s in recent),
            "errors_last_minute": sum(s[2] for s in recent),
            "requests_total": self.total,
        }

    def to_json(self, limit: int = 50, now: float | None = None) -> dict[str, Any]:
        """The dashboard's view: rates, usage by org and by model (most requests first),
        and the last `limit` requests, newest first."""
        return {
            "rates": self.rates(now),
            "by_org": _usage_rows("org_id", self.by_org),
            "by_model": _usage_rows("model", self.by_model),
            "recent": [s.to_json() for s in list(self.recent)[::-1][:limit]],
        }


def _usage_rows(name: str, usage: dict[str, UsageTotals]) -> list[dict[str, Any]]:
    rows = sorted(usage.items(), key=lambda item: -item[1].requests)
    return [{name: key, **value.to_json()} for key, value in rows]
