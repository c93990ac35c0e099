"""`/admin/v1/deployments/{name}/replicas`: the replicas of a deployment that Ray places
(`placement = "ray"`), listed and scaled through the gateway that serves it.

    GET  /admin/v1/deployments/{name}/replicas   its live replicas (Ray's registry), each
                                                 with this gateway's balancer state
    POST /admin/v1/deployments/{name}/replicas   {replicas: N}: scale to N within
                                                 min_replicas..max_replicas; answers
                                                 once the new ones serve, or the ones
                                                 taken away have drained

Admin scope required, as every `/admin/v1` route. 404: no such deployment here; 409: a
deployment not placed by Ray (its replicas are listed in the fleet file or started by
serve); 400: a count that is not an integer in range; 503: Ray failed the scale (a new
replica did not serve in time: the cluster may lack the resources it asks for). The
scaling itself is `cli/ray_admin.py`'s, which `tokenyard admin replicas scale` runs too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from tokenyard.api.admin import admin_of, request_args
from tokenyard.api.context import STATE, AppState, ReplicaScaler
from tokenyard.deployments import DeploymentSpec
from tokenyard.errors import APIError, invalid_request, not_found
from tokenyard.gateway.served import Served

PATH = "/admin/v1/deployments/{name}/replicas"


def ray_placed(deployments: Mapping[str, Served], name: str) -> Served:
    """The served deployment `name`, placed by Ray (404 unknown, 409 placed otherwise)."""
    served = deployments.get(name)
    if served is None:
        raise not_found(f"No deployment {name!r}.")
    if served.spec.ray is None:
        raise APIError(409, f"Deployment {name!r} is not placed by Ray: its replicas are "
                       "set by the fleet file (placement = \"ray\" scales through this "
                       "route).", code="not_ray_placed")
    return served


def wanted_count(spec: DeploymentSpec, body: Mapping[str, Any]) -> int:
    """The body's `replicas`, an integer within the deployment's range (400 otherwise)."""
    assert spec.ray is not None
    count = body.get("replicas")
    if isinstance(count, bool) or not isinstance(count, int):
        raise invalid_request("'replicas' must be an integer.", param="replicas")
    try:
        spec.ray.check(count)
    except ValueError as exc:
        raise invalid_request(f"{spec.name}: {exc}.", param="replicas") from None
    return count


def _scaler(state: AppState) -> ReplicaScaler:
    if state.scaler is None:  # a process built without one (not `serve`'s)
        raise APIError(409, "This process does not scale Ray-placed deployments.",
                       code="not_ray_placed")
    return state.scaler


def _reply(served: Served, found: list[dict[str, str]]) -> web.Response:
    spec = served.spec
    assert spec.ray is not None
    pool = {r["id"]: r for r in served.pool.snapshot()}
    return web.json_response({
        "object": "list", "deployment": spec.name, "min_replicas": spec.ray.min_replicas,
        "max_replicas": spec.ray.max_replicas,
        "data": [{**r, "balancer": pool.get(r["url"])} for r in found]})


async def replicas(request: web.Request) -> web.Response:
    admin_of(request)
    state = request.app[STATE]
    served = ray_placed(state.deployments, request.match_info["name"])
    return _reply(served, await _scaler(state).replicas(served.spec))


async def scale(request: web.Request) -> web.Response:
    admin_of(request)
    state = request.app[STATE]
    served = ray_placed(state.deployments, request.match_info["name"])
    count = wanted_count(served.spec, await request_args(request))
    try:
        found = await _scaler(state).scale(served.spec, count)
    except (RuntimeError, ConnectionError) as exc:
        raise APIError(503, f"Scaling {served.name} failed: {exc}",
                       code="scale_failed") from None
    # The pool follows at its next discovery round: a new replica's `balancer` is null
    # until then.
    return _reply(served, found)


def add_replica_routes(app: web.Application) -> None:
    """Register the Ray-placed replicas' admin routes on `app`."""
    app.router.add_get(PATH, replicas)
    app.router.add_post(PATH, scale)
