"""The operations routes anyone may call: GET /healthz, /readyz, /metrics and
/openapi.json (built from the dialects' pydantic models)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from tokenyard.api.anthropic import schemas as sa
from tokenyard.api.context import STATE
from tokenyard.api.openai import schemas as so
from tokenyard.api.respond import json_response
from tokenyard.telemetry.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE


async def healthz(request: web.Request) -> web.Response:
    """GET /healthz: this process is up."""
    return json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text; the engine's figures are read from the replica."""
    state = request.app[STATE]
    state.metrics.update_from_stats(await state.default.pool.stats())
    return web.Response(
        body=state.metrics.render().encode(), headers={"Content-Type": METRICS_CONTENT_TYPE}
    )


async def readyz(request: web.Request) -> web.Response:
    """GET /readyz: 200 only while admitting and the default deployment has a healthy
    replica."""
    state = request.app[STATE]
    ready = state.admitting and await state.default.pool.health()
    return json_response({"status": "ready" if ready else "unavailable"}, 200 if ready else 503)


_SCHEMA_MODELS: Sequence[type[BaseModel]] = (
    so.ChatCompletionRequest, so.ChatCompletion, so.ChatCompletionChunk,
    so.CompletionRequest, so.TextCompletion, so.ModelList,
    sa.MessagesRequest, sa.AnthropicMessage, sa.CountTokensRequest, sa.CountTokensResponse,
)

_ROUTES_DOC: Sequence[tuple[str, str, str | None, str]] = (
    ("/v1/chat/completions", "post", "ChatCompletionRequest", "ChatCompletion"),
    ("/v1/completions", "post", "CompletionRequest", "TextCompletion"),
    ("/v1/models", "get", None, "ModelList"),
    ("/v1/messages", "post", "MessagesRequest", "AnthropicMessage"),
    ("/v1/messages/count_tokens", "post", "CountTokensRequest", "CountTokensResponse"),
)


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document, built from the pydantic models' JSON schemas."""
    schemas: dict[str, Any] = {}
    for model in _SCHEMA_MODELS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        # Nested models move up to components, where the $refs point.
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    paths: dict[str, Any] = {}
    for path, method, request_name, response_name in _ROUTES_DOC:
        op: dict[str, Any] = {"responses": {"200": {
            "description": "OK",
            "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{response_name}"}
            }},
        }}}
        if request_name is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{request_name}"}
            }}}
        paths[path] = {method: op}
    return {
        "openapi": "3.1.0",
        "info": {"title": "tokenyard", "version": "0.1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }


async def openapi(request: web.Request) -> web.Response:
    """GET /openapi.json."""
    return json_response(openapi_document())


def add_ops_routes(app: web.Application) -> None:
    """The operations routes on `app`."""
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/metrics", metrics)
