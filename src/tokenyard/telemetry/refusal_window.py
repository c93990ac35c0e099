"""Refusals by reason over the last minute, read off the refusals counter
(`TokenyardMetrics.refusals`: every worker's, since start), the way `LatencyWindow` reads
the histograms: the counts now less those of the newest snapshot a window old."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenyard.telemetry.latency_window import Snapshots

Counts = Mapping[tuple[str, str, str, str], float]


class RefusalWindow:
    """Refusals per (stage, status, code, route) in the last `window_s` seconds."""

    def __init__(self, window_s: float = 60.0, step_s: float = 1.0) -> None:
        self._snapshots: Snapshots[Counts] = Snapshots(window_s, step_s)

    def rows(self, counts: Counts, now: float | None = None) -> list[dict[str, Any]]:
        """Each reason with refusals in the window (`count`) and since start (`total`),
        most in the window first."""
        base = self._snapshots.base(counts, now) or {}
        rows = sorted(
            ((int(total - base.get(labels, 0.0)), int(total), labels)
             for labels, total in counts.items()),
            key=lambda row: (-row[0], -row[1], row[2]))
        return [{"stage": stage, "status": int(status), "code": code, "route": route,
                 "count": count, "total": total}
                for count, total, (stage, status, code, route) in rows]
