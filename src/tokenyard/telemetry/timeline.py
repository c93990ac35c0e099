"""One request's timeline: named monotonic stamps and the stage durations between them.

Every stage stamps an event (``timeline.mark("parsed")``) as it finishes; durations are
computed only when asked, at the end, so the hot path costs one `time.perf_counter_ns`
call and one dict store per event. A stage lasts from the previous event that was stamped
(in `EVENTS` order) to its own, so optional stages (the gateway's, when it is off) simply
drop out. Stages that run many times per request (detokenization, once per step)
accumulate with `add`; they overlap the stage they run inside (detokenize inside decode).
"""

from __future__ import annotations

import time

#: Events in request order, each with the stage it ends (None: ends no reported stage).
EVENTS: tuple[tuple[str, str | None], ...] = (
    ("received", None),
    ("authenticated", "auth"),  # key → org, project (gateway)
    ("parsed", "parse"),
    ("templated", "template"),
    ("tokenized", "tokenize"),
    ("authorized", "authorize"),  # scopes: model, context (gateway)
    ("limited", "limit"),  # RPM/TPM/concurrency admitted (gateway)
    ("prechecked", "billing"),  # balance, spend cap, free tier (gateway)
    ("queued", None),  # sent to the replica
    ("admitted", "queue"),  # the replica scheduled it
    ("first_token", "prefill"),
    ("last_token", "decode"),
    ("done", None),
)
#: Stages measured piecewise with `Timeline.add`, reported after the event stages.
ACCUMULATED: tuple[str, ...] = ("balance", "moderate", "detokenize")
#: Every standard stage, in Server-Timing order.
STAGES: tuple[str, ...] = (
    *(stage for _, stage in EVENTS if stage is not None), *ACCUMULATED
)


def _format_ms(ns: int) -> str:
    # Three decimals (µs resolution) without trailing zeros keeps the header short.
    text = f"{ns / 1e6:.3f}".rstrip("0").rstrip(".")
    return text or "0"


class Timeline:
    """Monotonic event stamps (nanoseconds, `time.perf_counter_ns`) of one request.

    Cheap by design: `mark` is one clock read and one dict store. Not thread-safe: a request's
    timeline is touched only by the event-loop task that serves it.
    """

    __slots__ = ("_accumulated", "events", "lane", "num_tokens", "replica")

    def __init__(self, received_ns: int | None = None, lane: str = "live") -> None:
        #: event name → time in ns (perf_counter_ns); ``received`` is stamped at creation.
        self.events: dict[str, int] = {
            "received": time.perf_counter_ns() if received_ns is None else received_ns
        }
        #: tokens seen by `mark_token` (all completions together).
        self.num_tokens = 0
        self._accumulated: dict[str, int] = {}
        #: The replica (pool member id) the balancer chose, for the request's summary.
        self.replica: str | None = None
        #: The traffic the request belongs to: "live" (a client waits) or "batch" (a
        #: Batch API line): its latencies are kept apart (the metrics' `lane` label).
        self.lane = lane

    def mark(self, event: str, now_ns: int | None = None) -> int:
        """Stamp `event` now (or at `now_ns`); return the stamp in ns. A later mark replaces it."""
        stamp = time.perf_counter_ns() if now_ns is None else now_ns
        self.events[event] = stamp
        return stamp

    def mark_token(self, count: int = 1, now_ns: int | None = None) -> int | None:
        """Stamp the arrival of `count` new tokens: ``first_token`` once, ``last_token`` always.

        Returns the ns since the previous token arrival (an inter-token latency sample), or
        None for the first arrival.
        """
        stamp = time.perf_counter_ns() if now_ns is None else now_ns
        previous = self.events.get("last_token")
        # A caller that saw the first token arrive earlier may have stamped it already.
        self.events.setdefault("first_token", stamp)
        self.events["last_token"] = stamp
        self.num_tokens += count
        return None if previous is None else stamp - previous

    def add(self, stage: str, duration_ns: int) -> None:
        """Add `duration_ns` to a stage measured piecewise (e.g. detokenize, once per step).

        An accumulated stage replaces the duration its events would give.
        """
        self._accumulated[stage] = self._accumulated.get(stage, 0) + duration_ns

    def get(self, event: str) -> int | None:
        """The stamp of `event` in ns, or None if it was not stamped."""
        return self.events.get(event)

    def interval_ns(self, start: str, end: str) -> int | None:
        """ns from event `start` to event `end`, or None if either is missing."""
        a, b = self.events.get(start), self.events.get(end)
        if a is None or b is None:
            return None
        return max(0, b - a)

    def interval_s(self, start: str, end: str) -> float | None:
        """Seconds from event `start` to event `end`, or None if either is missing."""
        ns = self.interval_ns(start, end)
        return None if ns is None else ns / 1e9

    def durations_ns(self) -> dict[str, int]:
        """Stage → duration in ns, in `STAGES` order, for the stages that were measured."""
        out: dict[str, int] = {}
        previous: int | None = None
        for event, stage in EVENTS:
            stamp = self.events.get(event)
            if stamp is None:
                continue
            if stage is not None and previous is not None:
                out[stage] = max(0, stamp - previous)
            previous = stamp
        out.update(self._accumulated)  # detokenize, then custom stages, go last
        return out

    def timings_ms(self) -> dict[str, float]:
        """Stage → duration in ms (µs resolution), for the last event of a stream."""
        return {stage: round(ns / 1e6, 3) for stage, ns in self.durations_ns().items()}

    def server_timing(self) -> str:
        """The ``Server-Timing`` header value: ``parse;dur=0.12, template;dur=0.03, …`` (ms).

        Syntax per W3C Server Timing: metrics separated by ``,``, each a token name with a
        ``dur`` parameter in milliseconds. Empty when nothing was measured.
        """
        return ", ".join(
            f"{stage};dur={_format_ms(ns)}" for stage, ns in self.durations_ns().items()
        )
