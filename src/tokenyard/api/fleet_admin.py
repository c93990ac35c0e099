"""`/admin/v1/…` over the fleet this process serves (its `AppState`, not the store):

    GET  /admin/v1/deployments       deployments (kind, capabilities, prices, max_context,
                                     each replica's balancer state) and aliases (weights,
                                     shadow)
    POST /admin/v1/replicas/drain    {deployment, replica, drain?: bool (default true)}:
                                     stop (or resume) sending new work to one
                                     replica; running requests finish
    GET, POST /admin/v1/deployments/{name}/replicas   a Ray-placed deployment's replicas,
                                     and scaling it (`api/replica_scaling.py`)
    /admin/v1/models/…               on-demand models: load, unload, pin (`api/model_admin.py`)

Admin scope required, as every `/admin/v1` route.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from aiohttp import web

from tokenyard.api.admin import admin_of, refusal, request_args
from tokenyard.api.context import STATE
from tokenyard.api.model_admin import add_model_admin_routes
from tokenyard.api.replica_scaling import add_replica_routes
from tokenyard.deployments import AliasSpec, PriceSpec
from tokenyard.errors import invalid_request
from tokenyard.gateway.admin import AdminError, flag
from tokenyard.gateway.served import Served


def _money(micros: int) -> str:
    """Micros as a decimal currency amount, two decimals at least ("0.10", "0.0125")."""
    whole, _, fraction = f"{Decimal(micros).scaleb(-6):.6f}".rstrip("0").partition(".")
    return f"{whole}.{fraction.ljust(2, '0')}"


def _prices(prices: PriceSpec | None) -> dict[str, str] | None:
    if prices is None:
        return None
    return {"input": _money(prices.input), "cached_input": _money(prices.cached_input),
            "output": _money(prices.output)}


def deployment_json(served: Served) -> dict[str, Any]:
    spec = served.spec
    max_context = spec.max_context or (served.info.max_model_len if served.info else None)
    return {
        "name": served.name, "kind": served.kind, "model": spec.model,
        "capabilities": sorted(spec.capabilities), "max_context": max_context,
        "prices": _prices(spec.prices), "replicas": served.pool.snapshot(),
    }


def alias_json(alias: AliasSpec) -> dict[str, Any]:
    shadow = alias.shadow
    return {
        "name": alias.name, "routes": dict(alias.routes),
        "shadow": {"deployment": shadow.deployment, "share": shadow.share}
        if shadow is not None else None,
    }


async def deployments(request: web.Request) -> web.Response:
    admin_of(request)
    state = request.app[STATE]
    return web.json_response({
        "object": "list",
        "data": [deployment_json(s) for s in state.deployments.values()],
        "aliases": [alias_json(a) for a in state.router.fleet.aliases.values()],
    })


async def drain(request: web.Request) -> web.Response:
    admin_of(request)
    body = await request_args(request)
    name, replica = body.get("deployment"), body.get("replica")
    served = request.app[STATE].deployments.get(name) if isinstance(name, str) else None
    if served is None:
        raise invalid_request(f"No deployment {name!r}.", param="deployment")
    try:
        draining = flag(body, "drain", default=True)  # null: refused (it would drain)
    except AdminError as exc:
        raise refusal(exc) from None
    if not isinstance(replica, str) or not served.pool.drain(replica, draining):
        known = ", ".join(m.id for m in served.pool.members)
        raise invalid_request(f"No replica {replica!r} in {served.name} (its replicas: "
                              f"{known}).", param="replica")
    state = next(r for r in served.pool.snapshot() if r["id"] == replica)
    return web.json_response({"deployment": served.name, **state})


def add_fleet_routes(app: web.Application) -> None:
    """Register the fleet's admin routes on `app`."""
    app.router.add_get("/admin/v1/deployments", deployments)
    app.router.add_post("/admin/v1/replicas/drain", drain)
    add_replica_routes(app)
    add_model_admin_routes(app)
