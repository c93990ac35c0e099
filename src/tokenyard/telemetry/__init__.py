"""Observation of requests (DESIGN §1 stage 20).

- `timeline`: monotonic event stamps for one request → stage durations, the
  ``Server-Timing`` header and the timings sent in a stream's last event.
- `metrics`: a small Prometheus registry (counters, gauges, histograms) and tokenyard's
  metrics, named like vLLM's with the ``tokenyard:`` prefix, rendered for ``/metrics``.

Nothing here imports torch or third-party packages: the HTTP process stamps and renders.
"""

from tokenyard.telemetry.metrics import (
    Counter,
    Gauge,
    Histogram,
    Registry,
    TokenyardMetrics,
    render,
)
from tokenyard.telemetry.timeline import STAGES, Timeline

__all__ = [
    "STAGES",
    "Counter",
    "Gauge",
    "Histogram",
    "Registry",
    "Timeline",
    "TokenyardMetrics",
    "render",
]
