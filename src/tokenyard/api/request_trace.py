"""A finished request as OpenTelemetry spans (only when tracing is on): the server span
``POST /v1/chat/completions`` with the GenAI semantic conventions' attributes and
tokenyard's, and one child span per timeline stage. The replica adds its own ``queue``,
``prefill`` and ``decode`` spans to the same trace (engine/server.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from tokenyard.api.context import GENERATIONS, RESPONSE_ID, TIMELINE
from tokenyard.telemetry import tracing
from tokenyard.telemetry.request_log import RequestSummary
from tokenyard.telemetry.timeline import ACCUMULATED, STAGES
from tokenyard.telemetry.tracing import SpanData, TraceIds

#: gen_ai.operation.name by route.
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/messages": "chat",
    "/v1/responses": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}
#: gen_ai.provider.name (and the older gen_ai.system): who served the model.
PROVIDER = "tokenyard"


def trace_request(request: web.Request, summary: RequestSummary, ids: TraceIds) -> None:
    """Export the request's spans, timed from its timeline."""
    timeline = request[TIMELINE]
    offset = tracing.wall_offset_ns()
    start = timeline.events["received"] + offset
    root = SpanData(f"{summary.method} {summary.path}", start, time.perf_counter_ns() + offset,
                    attributes(request, summary),
                    error=summary.error_code if summary.status >= 500 else None)
    tracing.export(ids, root, tracing.stage_spans(timeline, offset))


def attributes(request: web.Request, summary: RequestSummary) -> dict[str, Any]:
    """The server span's attributes: HTTP's, the GenAI conventions', tokenyard's."""
    gens: Sequence[Any] = request.get(GENERATIONS) or ()
    params = gens[0].params if gens else None
    out: dict[str, Any] = {
        "http.request.method": summary.method,
        "url.path": summary.path,
        "http.response.status_code": summary.status,
        "error.type": summary.error_code,
        "tokenyard.request_id": summary.request_id,
        "tokenyard.org_id": summary.org_id,
        "tokenyard.project_id": summary.project_id,
        "tokenyard.user_id": summary.user_id,
        "tokenyard.key_prefix": summary.key_prefix,
        "tokenyard.deployment": summary.deployment,
        "tokenyard.replica": summary.replica,
        "tokenyard.usage.cached_tokens": summary.cached_tokens,
        "tokenyard.cost": None if summary.cost is None else str(summary.cost),
        "tokenyard.stream": summary.stream,
    }
    for stage, ms in summary.timings_ms.items():  # no single interval: attributes (the
        if stage in ACCUMULATED or stage not in STAGES:  # MCP loop's hops and calls too)
            out[f"tokenyard.{stage}_ms"] = ms
    operation = OPERATIONS.get(summary.path)
    if operation is None:
        return out
    out.update({
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.system": PROVIDER,
        "gen_ai.request.model": summary.model,
        "gen_ai.response.model": summary.deployment,
        "gen_ai.response.id": request.get(RESPONSE_ID),
        "gen_ai.usage.input_tokens": summary.prompt_tokens,
        "gen_ai.usage.output_tokens": summary.output_tokens,
    })
    if params is not None:
        out["gen_ai.request.max_tokens"] = params.max_tokens
        out["gen_ai.request.temperature"] = params.temperature
        if params.top_p is not None:
            out["gen_ai.request.top_p"] = params.top_p
    if summary.finish_reason:
        out["gen_ai.response.finish_reasons"] = summary.finish_reason.split(",")
    return out
