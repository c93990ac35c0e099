"""The replica's spans of one traced request (only when tracing is on and the gateway
sent a ``traceparent``): a server span for the generate call, child of the gateway's
request span, and under it ``queue`` (arrival → first scheduled), ``prefill`` (→ first
token) and ``decode`` (→ the last output). The replica knows these times itself: its
first output carries the queue and prefill times; the rest is the stream's end."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from tokenyard.telemetry import tracing
from tokenyard.telemetry.tracing import SpanData, TraceIds

#: The service name of the replica's spans (unless OTEL_SERVICE_NAME is set).
SERVICE = "tokenyard-replica"


class ReplicaSpans:
    """Collects one request's timings as its outputs go by; `export` at its end."""

    __slots__ = ("_arrived_ns", "_ids", "_outputs", "_prefill_s", "_queue_s", "request_id")

    def __init__(self, ids: TraceIds, request_id: str) -> None:
        self._ids = ids
        self.request_id = request_id
        self._arrived_ns = time.time_ns()
        self._queue_s: float | None = None
        self._prefill_s: float | None = None
        self._outputs = 0

    @classmethod
    def start(cls, headers: Mapping[str, str], request_id: str) -> ReplicaSpans | None:
        """The spans of a request whose caller traces it; None otherwise (or tracing off)."""
        if not tracing.enabled():
            return None
        value = headers.get(tracing.TRACEPARENT)
        if value is None:
            return None
        ids = tracing.begin(value)
        return cls(ids, request_id) if ids is not None and ids.parent_id is not None else None

    def saw(self, outputs: Iterable[Any]) -> None:
        """One step's outputs of the request (the first carries the queue/prefill times)."""
        for out in outputs:
            self._outputs += 1
            if self._queue_s is None and getattr(out, "queue_time", None) is not None:
                self._queue_s = out.queue_time
                self._prefill_s = out.prefill_time or 0.0

    def export(self, error: str | None = None) -> None:
        """Export the spans now that the request's stream ended."""
        end = time.time_ns()
        root = SpanData("POST /v1/engine/generate", self._arrived_ns, end, {
            "tokenyard.request_id": self.request_id, "tokenyard.outputs": self._outputs,
        }, error=error)
        children = []
        if self._queue_s is not None:
            queued = self._arrived_ns + int(self._queue_s * 1e9)
            first = queued + int((self._prefill_s or 0.0) * 1e9)
            children = [SpanData("queue", self._arrived_ns, queued),
                        SpanData("prefill", queued, first), SpanData("decode", first, end)]
        tracing.export(self._ids, root, children, service=SERVICE)
