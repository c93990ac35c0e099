"""The values a trace is made of, shared by `telemetry.tracing` (which builds them) and
`telemetry.otel_export` (which hands them to the OpenTelemetry SDK): no SDK here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TraceIds:
    """One process's span of a request: its trace, its own id, its parent's (the
    caller's span; None for a new trace) and whether the trace is sampled."""

    trace_id: int
    span_id: int
    parent_id: int | None
    sampled: bool

    def traceparent(self) -> str:
        """The W3C ``traceparent`` that makes this span the parent of the callee's."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"


@dataclass(slots=True)
class SpanData:
    """A finished span to export: times in ns since the epoch."""

    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the span's status is ERROR with this description


def clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """`attributes` without the None values (OTLP has no null attribute)."""
    return {k: v for k, v in attributes.items() if v is not None}
