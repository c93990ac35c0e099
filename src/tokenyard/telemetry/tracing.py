"""OpenTelemetry traces, at no cost when they are off.

Tracing is on only when a standard OTLP endpoint variable is set
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) and
``OTEL_SDK_DISABLED`` is not ``true``. Off, nothing here imports the SDK and a request
pays one cached boolean check.

On, no span lives while a request runs: the request gets its ids when it arrives
(`begin`: the caller's trace from a W3C ``traceparent``, else a new one), calls to a
replica carry ``traceparent`` naming the request's span (`OUTGOING`), and when the
request ended its spans are built at once with their real start and end times
(`export`) and handed to the SDK's batch processor, which exports them from its own
thread: nothing on the request path waits for the collector. Every process (each HTTP
worker, each replica) exports its own spans.

The SDK half lives in `telemetry/otel_export.py`, imported on the first export.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from contextvars import ContextVar
from functools import cache

from tokenyard.telemetry.spans import SpanData, TraceIds, clean
from tokenyard.telemetry.timeline import EVENTS, Timeline

__all__ = ["OUTGOING", "TRACEPARENT", "SpanData", "TraceIds", "begin", "clean", "enabled",
           "export", "parse_traceparent", "stage_spans", "wall_offset_ns"]

TRACEPARENT = "traceparent"
#: The ``traceparent`` an outgoing call to a replica carries (None: not traced).
OUTGOING: ContextVar[str | None] = ContextVar("tokenyard_traceparent", default=None)


@cache
def enabled() -> bool:
    """Whether traces are exported (read once per process from the environment)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def parse_traceparent(value: str | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C ``traceparent``; None when absent or
    malformed (all-zero ids, a wrong length, version ff)."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff":
        return None
    version, trace, span, flags = parts[:4]
    if len(trace) != 32 or len(span) != 16 or len(flags) != 2 or (
            version == "00" and len(parts) != 4):
        return None
    try:
        trace_id, span_id, bits = int(trace, 16), int(span, 16), int(flags, 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(bits & 1)


def begin(traceparent: str | None) -> TraceIds | None:
    """The ids of a request's span, under the caller's trace when `traceparent` names
    one (sampled as the caller decided), else in a new sampled trace; None when tracing
    is off."""
    if not enabled():
        return None
    parent = parse_traceparent(traceparent)
    span_id = random.getrandbits(64) or 1
    if parent is None:
        return TraceIds(random.getrandbits(128) or 1, span_id, None, True)
    return TraceIds(parent[0], span_id, parent[1], parent[2])


def wall_offset_ns() -> int:
    """What to add to a `time.perf_counter_ns` stamp to get ns since the epoch."""
    return time.time_ns() - time.perf_counter_ns()


def stage_spans(timeline: Timeline, offset_ns: int) -> list[SpanData]:
    """One span per stage the timeline measured between two events (parse, template,
    tokenize, the gateway's stages, queue, prefill, decode), with the stage's real start
    and end. Accumulated stages (balance, detokenize) have no single interval: the caller
    reports them as attributes."""
    spans: list[SpanData] = []
    previous: int | None = None
    for event, stage in EVENTS:
        stamp = timeline.events.get(event)
        if stamp is None:
            continue
        if stage is not None and previous is not None:
            spans.append(SpanData(stage, previous + offset_ns, max(previous, stamp) + offset_ns))
        previous = stamp
    return spans


def export(
    ids: TraceIds, root: SpanData, children: Sequence[SpanData] = (), *,
    kind: str = "server", service: str = "tokenyard",
) -> None:
    """Export the request's span `root` (kind ``server`` or ``internal``) with id
    `ids.span_id` under `ids.parent_id`, and `children` under it; a no-op for an
    unsampled trace. `service`: the service name unless ``OTEL_SERVICE_NAME`` is set."""
    if not ids.sampled:
        return
    from tokenyard.telemetry import otel_export  # the SDK, only once tracing is used

    otel_export.emit(ids, root, children, kind=kind, service=service)
