"""Observation of requests (DESIGN §1 stage 20).

- `timeline`: monotonic event stamps for one request → stage durations, the
  ``Server-Timing`` header and the timings sent in a stream's last event.
- `metrics`: tokenyard's metrics, kept by prometheus_client (in its multiprocess mode with
  several HTTP workers), named like vLLM's with the ``tokenyard:`` prefix, rendered for
  ``/metrics``.

Nothing here imports torch: the HTTP process stamps and renders.
"""

from tokenyard.telemetry.metrics import TokenyardMetrics
from tokenyard.telemetry.timeline import STAGES, Timeline

__all__ = [
    "STAGES",
    "Timeline",
    "TokenyardMetrics",
]
