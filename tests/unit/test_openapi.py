"""/openapi.json lists every route the app serves but the browser pages: each API route
with its request and response models and path parameters, each keyed route with its
security and its dialect's error body."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from tokenyard.api.app import make_app
from tokenyard.api.context import AppState
from tokenyard.api.ops import openapi
from tokenyard.api.web import is_public
from tokenyard.deployments import FleetSpec
from tokenyard.gateway.routing import Router


def _served_document() -> tuple[dict[str, Any], set[tuple[str, str]]]:
    """What GET /openapi.json answers for a real app, and that app's routes."""
    app = make_app(AppState({}, Router(FleetSpec(deployments={})), 0))
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
              if r.resource is not None and r.method != "HEAD"
              and not is_public(r.resource.canonical)}

    class Request:  # all the handler reads of its request
        def __init__(self) -> None:
            self.app = app

    response = asyncio.run(openapi(Request()))  # type: ignore[arg-type]
    assert isinstance(response, web.Response) and response.body is not None
    return json.loads(bytes(response.body)), routes  # type: ignore[arg-type]


def test_every_route_of_the_app_is_in_the_document() -> None:
    doc, routes = _served_document()
    listed = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert routes - listed == set()
    for path in ("/v1/embeddings", "/v1/moderations", "/v1/responses/{response_id}",
                 "/v1/responses/{response_id}/input_items", "/admin/v1/keys"):
        assert path in doc["paths"]


def test_keyed_routes_carry_security_errors_and_path_parameters() -> None:
    doc, _ = _served_document()
    schemas = doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            public = path in ("/healthz", "/readyz", "/metrics", "/openapi.json")
            assert (op["security"] == []) == public, (method, path)
            if public:
                continue
            error = op["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"]
            assert error.endswith("AnthropicError" if path.startswith("/v1/messages")
                                  else "OpenAIError")
            names = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert names == {part[1:-1] for part in path.split("/") if part.startswith("{")}
    post = doc["paths"]["/v1/embeddings"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "EmbeddingRequest") and "EmbeddingRequest" in schemas
    assert "500" not in doc["paths"]["/v1/chat/completions"]["post"]["responses"]
