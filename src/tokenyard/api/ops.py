"""The operations routes anyone may call: GET /healthz, /readyz, /metrics and
/openapi.json (api/openapi.py)."""

from __future__ import annotations

from aiohttp import web

from tokenyard.api.context import STATE
from tokenyard.api.openapi import openapi_document
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


async def openapi(request: web.Request) -> web.Response:
    """GET /openapi.json: the API, and this router's administrative routes."""
    admin = tuple(sorted({(route.method, route.resource.canonical)
                          for route in request.app.router.routes()
                          if route.resource is not None and route.method != "HEAD"
                          and route.resource.canonical.startswith("/admin/")}))
    return json_response(openapi_document(admin))


def add_ops_routes(app: web.Application) -> None:
    """The operations routes on `app`."""
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/metrics", metrics)
