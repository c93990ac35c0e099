"""Latency percentiles of the last minute, read off the metrics' cumulative histograms.

The histograms (`telemetry/metrics.py`) count since start; a dashboard wants what is
happening now. `LatencyWindow` keeps snapshots of the cumulative bucket counts (one per
`step_s` at most, as the dashboard polls) and answers with the difference between now
and the newest snapshot at least a window old, so a percentile covers the requests that
finished in the last minute or so (since start, until a snapshot is that old).
Percentiles are interpolated inside a bucket as Prometheus's ``histogram_quantile``
does; with a few requests, they are as coarse as the buckets.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Generic, TypeVar

from tokenyard.telemetry.metrics import Buckets

T = TypeVar("T")

#: The percentiles reported, as fractions.
QUANTILES = (0.5, 0.9, 0.99)


def bucket_quantile(buckets: Buckets, q: float) -> float | None:
    """The `q` quantile (0..1) of cumulative `buckets` ((upper bound, count), …, +Inf
    last), interpolated linearly within its bucket; None without observations. A rank
    in the +Inf bucket answers the highest finite bound."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def _minus(now: Buckets, then: Buckets | None) -> Buckets:
    if then is None or len(then) != len(now):
        return now
    return tuple((bound, count - old) for (bound, count), (_, old) in zip(now, then, strict=True))


class Snapshots(Generic[T]):
    """Snapshots of cumulative figures (one per `step_s` at most, as they are read), to
    subtract the one of a window ago from the figures now."""

    def __init__(self, window_s: float = 60.0, step_s: float = 1.0) -> None:
        self.window_s = window_s
        self.step_s = step_s
        self._snapshots: deque[tuple[float, T]] = deque()

    def base(self, current: T, now: float | None = None) -> T | None:
        """The newest snapshot at least a window old (None until one is that old: then
        everything since start counts), and `current` kept as a snapshot."""
        now = time.monotonic() if now is None else now
        while len(self._snapshots) > 1 and now - self._snapshots[1][0] >= self.window_s:
            self._snapshots.popleft()  # the oldest still at least a window back stays
        old = self._snapshots and now - self._snapshots[0][0] >= self.window_s
        base = self._snapshots[0][1] if old else None
        if not self._snapshots or now - self._snapshots[-1][0] >= self.step_s:
            self._snapshots.append((now, current))
        return base


class LatencyWindow:
    """Percentiles over the last `window_s` seconds of each histogram it is given."""

    def __init__(self, window_s: float = 60.0, step_s: float = 1.0) -> None:
        self._snapshots: Snapshots[Mapping[str, Buckets]] = Snapshots(window_s, step_s)

    def percentiles(
        self, histograms: Mapping[str, Buckets], now: float | None = None,
        quantiles: Sequence[float] = QUANTILES,
    ) -> dict[str, dict[str, float | int | None]]:
        """name → {"p50": seconds, …, "count": observations in the window}, from the
        histograms' cumulative counts now (`TokenyardMetrics.histogram_buckets`)."""
        base = self._snapshots.base(histograms, now) or {}
        out: dict[str, dict[str, float | int | None]] = {}
        for name, buckets in histograms.items():
            recent = _minus(buckets, base.get(name))
            row: dict[str, float | int | None] = {
                f"p{round(q * 100)}": bucket_quantile(recent, q) for q in quantiles}
            row["count"] = int(recent[-1][1]) if recent else 0
            out[name] = row
        return out
