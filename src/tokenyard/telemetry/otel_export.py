"""The OpenTelemetry SDK side of `telemetry.tracing`: imported on a process's first
export, never when tracing is off.

Spans are built as finished `ReadableSpan`s with the ids `tracing` chose and handed to
one `BatchSpanProcessor` over the OTLP/HTTP exporter, which reads its endpoint, headers,
timeout and the batch settings (``OTEL_BSP_*``) from the standard variables and exports
from its own thread. No tracer provider is installed: tokenyard's spans are made at the
request's end, not through a tracer while it runs, so nothing global changes for other
code in the process.
"""

from __future__ import annotations

import atexit
import os
import random
from collections.abc import Sequence
from functools import cache

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from tokenyard.telemetry.spans import SpanData, TraceIds, clean

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_SCOPE = InstrumentationScope("tokenyard")
_KINDS = {"server": SpanKind.SERVER, "internal": SpanKind.INTERNAL}


@cache
def _processor() -> BatchSpanProcessor:
    processor = BatchSpanProcessor(OTLPSpanExporter())
    atexit.register(processor.shutdown)  # export what is queued when the process ends
    return processor


@cache
def _resource(service: str) -> Resource:
    # OTEL_SERVICE_NAME (and OTEL_RESOURCE_ATTRIBUTES) win; else the process's own name.
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    return Resource.create(attributes)


def _span(
    data: SpanData, context: SpanContext, parent: SpanContext | None, kind: SpanKind,
    resource: Resource,
) -> ReadableSpan:
    status = (Status(StatusCode.ERROR, data.error) if data.error is not None
              else Status(StatusCode.UNSET))
    return ReadableSpan(
        data.name, context=context, parent=parent, resource=resource,
        attributes=clean(data.attributes), kind=kind, status=status,
        start_time=data.start_ns, end_time=max(data.start_ns, data.end_ns),
        instrumentation_scope=_SCOPE,
    )


def emit(
    ids: TraceIds, root: SpanData, children: Sequence[SpanData], *, kind: str, service: str,
) -> None:
    """Queue `root` and its `children` for export (see `tracing.export`)."""
    processor, resource = _processor(), _resource(service)
    context = SpanContext(ids.trace_id, ids.span_id, is_remote=False, trace_flags=_SAMPLED)
    parent = (SpanContext(ids.trace_id, ids.parent_id, is_remote=True, trace_flags=_SAMPLED)
              if ids.parent_id is not None else None)
    processor.on_end(_span(root, context, parent, _KINDS[kind], resource))
    for child in children:
        child_context = SpanContext(ids.trace_id, random.getrandbits(64) or 1,
                                    is_remote=False, trace_flags=_SAMPLED)
        processor.on_end(_span(child, child_context, context, SpanKind.INTERNAL, resource))

