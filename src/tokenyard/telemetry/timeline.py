"""One request's timeline: named monotonic stamps and the stage durations between them.

Every stage of the HTTP process stamps an event (``timeline.mark("parsed")``) as it finishes;
durations are computed only when asked, at the end, so the hot path costs one
`time.perf_counter_ns` call and one dict store per event. Stages that run many times per
request (detokenization, once per step) accumulate with `add`.

Events, in order: ``received``, ``parsed``, ``templated``, ``tokenized``, ``queued``,
``admitted``, ``first_token``, ``last_token``, ``detokenized``, ``done``.
"""

from __future__ import annotations

import time

#: Stage name → (start event, end event). Order is the order of Server-Timing entries.
STAGES: dict[str, tuple[str, str]] = {
    "parse": ("received", "parsed"),
    "template": ("parsed", "templated"),
    "tokenize": ("templated", "tokenized"),
    "queue": ("queued", "admitted"),
    "prefill": ("admitted", "first_token"),
    "decode": ("first_token", "last_token"),
    "detokenize": ("last_token", "detokenized"),
}


def _format_ms(ns: int) -> str:
    # Three decimals (µs resolution) without trailing zeros keeps the header short.
    text = f"{ns / 1e6:.3f}".rstrip("0").rstrip(".")
    return text or "0"


class Timeline:
    """Monotonic event stamps (nanoseconds, `time.perf_counter_ns`) of one request.

    Cheap by design: `mark` is one clock read and one dict store. Not thread-safe: a request's
    timeline is touched only by the event-loop task that serves it.
    """

    __slots__ = ("_accumulated", "events", "num_tokens")

    def __init__(self, received_ns: int | None = None) -> None:
        #: event name → time in ns (perf_counter_ns); ``received`` is stamped at creation.
        self.events: dict[str, int] = {
            "received": time.perf_counter_ns() if received_ns is None else received_ns
        }
        #: tokens seen by `mark_token` (all completions together).
        self.num_tokens = 0
        self._accumulated: dict[str, int] = {}

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
        if previous is None:
            self.events["first_token"] = stamp
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
        for stage, (start, end) in STAGES.items():
            if stage in self._accumulated:
                out[stage] = self._accumulated[stage]
                continue
            ns = self.interval_ns(start, end)
            if ns is not None:
                out[stage] = ns
        for stage, ns in self._accumulated.items():
            out.setdefault(stage, ns)  # custom stages go after the standard ones
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
