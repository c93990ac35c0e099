"""`/admin/v1/models/…`: the deployments loaded on demand (`load = "on_demand"`,
`balancer/on_demand.py`), listed, loaded, unloaded and pinned through the server that
runs them.

    GET  /admin/v1/models                 every deployment's load state (an always-loaded
                                          one is "loaded", on_demand false) and the host's
                                          budget (max_resident_models)
    POST /admin/v1/models/{name}/load     load it now; answers once it serves
    POST /admin/v1/models/{name}/unload   unload it; its running requests end first
    POST /admin/v1/models/{name}/pin      never unload it (idle, or for another's room)
    POST /admin/v1/models/{name}/unpin    unload it again when idle or for room

Admin scope required, as every `/admin/v1` route. 404: no such deployment here; 409: a
deployment loaded always (not on demand), or an unload of a pinned model; 503: the load
failed (its replica did not start, or every resident model is pinned).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tokenyard.api.admin import admin_of
from tokenyard.api.context import STATE
from tokenyard.errors import APIError, not_found
from tokenyard.gateway.served import Served


def _state(served: Served) -> dict[str, Any]:
    demand = served.pool.demand
    row: dict[str, Any] = {"name": served.name, "kind": served.kind,
                           "status": served.status, "on_demand": demand is not None}
    if demand is not None:
        row.update(demand.snapshot())
    return row


def _on_demand(request: web.Request) -> Served:
    """The deployment the path names, loaded on demand (404 unknown, 409 loaded always)."""
    admin_of(request)
    name = request.match_info["name"]
    served = request.app[STATE].deployments.get(name)
    if served is None:
        raise not_found(f"No deployment {name!r}.")
    if served.pool.demand is None:
        raise APIError(409, f"Deployment {name!r} is loaded always: only a deployment with "
                       "load = \"on_demand\" is loaded, unloaded and pinned here.",
                       code="not_on_demand")
    return served


async def models(request: web.Request) -> web.Response:
    admin_of(request)
    state = request.app[STATE]
    budget = next((s.pool.demand.host.max_resident for s in state.deployments.values()
                   if s.pool.demand is not None), None)
    return web.json_response({"object": "list", "max_resident_models": budget,
                              "data": [_state(s) for s in state.deployments.values()]})


async def load(request: web.Request) -> web.Response:
    served = _on_demand(request)
    assert served.pool.demand is not None
    try:
        await served.pool.demand.load()
    except RuntimeError as exc:
        raise APIError(503, f"Loading {served.name} failed: {exc}",
                       type="service_unavailable_error", code="model_load_failed") from None
    return web.json_response(_state(served))


async def unload(request: web.Request) -> web.Response:
    served = _on_demand(request)
    demand = served.pool.demand
    assert demand is not None
    if demand.pinned:
        raise APIError(409, f"{served.name} is pinned: unpin it first.", code="model_pinned")
    await demand.unload()
    return web.json_response(_state(served))


async def _pin(request: web.Request, pinned: bool) -> web.Response:
    served = _on_demand(request)
    assert served.pool.demand is not None
    served.pool.demand.pinned = pinned
    return web.json_response(_state(served))


async def pin(request: web.Request) -> web.Response:
    return await _pin(request, True)


async def unpin(request: web.Request) -> web.Response:
    return await _pin(request, False)


def add_model_admin_routes(app: web.Application) -> None:
    """Register the on-demand models' admin routes on `app`."""
    app.router.add_get("/admin/v1/models", models)
    for verb, handler in (("load", load), ("unload", unload), ("pin", pin),
                          ("unpin", unpin)):
        app.router.add_post(f"/admin/v1/models/{{name}}/{verb}", handler)
