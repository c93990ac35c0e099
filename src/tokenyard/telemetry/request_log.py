"""One summary per finished request, and the observers that consume it.

The HTTP layer builds a `RequestSummary` once per request, when it ended (after its
last byte, its error, or the client leaving), and hands it to `publish`. Observers are
what turn it into something: the JSON log line, a store of request records, a
dashboard's ring of recent requests. The summary holds figures and names only — never
a prompt, an output or a header value other than the request id — so an observer cannot
leak what a client sent.

Observers run inline on the event loop, so they must be cheap (append to a deque, queue
a write); one that raises is logged once and never breaks the request or the observers
after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from decimal import Decimal
from typing import Any

logger = logging.getLogger("tokenyard.telemetry")

#: Where a request came from: its summary's and its request record's `lane`.
LANES = ("live", "batch", "background")


@dataclass(frozen=True, slots=True)
class RequestSummary:
    """What one request was and how it went. Counts are of all its completions."""

    request_id: str
    #: Wall-clock time the request arrived (seconds since the epoch).
    started_at: float
    method: str
    path: str
    #: The HTTP status sent (499: the client went away before the response ended).
    status: int
    #: The first characters of the API key (None: no key, e.g. a public route).
    key_prefix: str | None = None
    org_id: str | None = None
    project_id: str | None = None
    #: The user the key belongs to (None: a key of no user).
    user_id: str | None = None
    #: The model name the client asked for, and the deployment that served it.
    model: str | None = None
    deployment: str | None = None
    #: The replica (pool member id) that generated the output.
    replica: str | None = None
    #: The region of that deployment (None: it declares none).
    region: str | None = None
    #: The API error code of a refused or failed request (e.g. ``rate_limit_exceeded``).
    error_code: str | None = None
    #: How the completions ended, comma-joined in order (``stop``, ``length``, ``abort``).
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    #: What the request was billed (currency units, exact); None when not billed.
    cost: Decimal | None = None
    #: Stage → milliseconds, as the response's Server-Timing / `timings` report them.
    timings_ms: dict[str, float] = field(default_factory=dict)
    stream: bool = False
    #: The request's whole duration in ms, from arrival to its end.
    duration_ms: float = 0.0
    #: A request with fallbacks: each candidate tried, in order ({model, deployment,
    #: outcome, error_code}); None for a request without.
    attempts: tuple[dict[str, Any], ...] | None = None
    #: Where it came from (`LANES`): "live" (a client waited on it), "batch" (a Batch
    #: API line) or "background" (a background response).
    lane: str = "live"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (cost as a decimal string)."""
        # Flat fields: a shallow dict, not asdict's recursive deep copy (~10× slower).
        value = {name: getattr(self, name) for name in _FIELDS}
        value["timings_ms"] = dict(self.timings_ms)
        value["attempts"] = None if self.attempts is None else list(self.attempts)
        value["cost"] = None if self.cost is None else str(self.cost)
        return value


_FIELDS = tuple(f.name for f in fields(RequestSummary))


Observer = Callable[[RequestSummary], None]

_observers: list[Observer] = []
_failed: set[int] = set()


def add_observer(fn: Observer) -> None:
    """Call `fn` with every finished request's summary (in this process)."""
    if fn not in _observers:
        _observers.append(fn)


def remove_observer(fn: Observer) -> None:
    """Stop calling `fn` (a no-op if it was not added)."""
    if fn in _observers:
        _observers.remove(fn)


def has_observers() -> bool:
    """Whether anyone listens: without observers a summary need not be built at all."""
    return bool(_observers)


def publish(summary: RequestSummary) -> None:
    """Hand `summary` to every observer; a failing observer is logged (once) and skipped."""
    for fn in tuple(_observers):
        try:
            fn(summary)
        except Exception:
            if id(fn) not in _failed:
                _failed.add(id(fn))
                logger.exception("request observer %r failed; it is skipped for this request",
                                 fn)
