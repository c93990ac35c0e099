"""`/admin/v1/deployments/{name}/adapters`: LoRA adapters registered on a running engine
deployment (`gateway/lora_admin.py`).

    POST   /admin/v1/deployments/{name}/adapters            {name, path, prices?}: every
                                                            replica loads the PEFT folder
                                                            `path` (on its host); served
                                                            from then on as `{name}:{adapter}`
    DELETE /admin/v1/deployments/{name}/adapters/{adapter}  stop serving it

Admin scope required, as every `/admin/v1` route. 404: no such deployment or adapter;
400: a bad name, an adapter a replica cannot load (the reason), one an alias routes to.
"""

from __future__ import annotations

from aiohttp import web

from tokenyard.api.admin import admin_of, request_args
from tokenyard.api.context import STATE
from tokenyard.api.fleet_admin import deployment_json
from tokenyard.deployments import PriceSpec
from tokenyard.errors import invalid_request
from tokenyard.fleet_values import FleetConfigError, price_spec
from tokenyard.gateway.lora_admin import register_adapter, unregister_adapter

PATH = "/admin/v1/deployments/{name}/adapters"


async def register(request: web.Request) -> web.Response:
    admin_of(request)
    body = await request_args(request)  # the schema (RegisterAdapter) has checked it
    prices: PriceSpec | None = None
    if body.get("prices") is not None:
        try:
            prices = price_spec(body["prices"], "prices")
        except FleetConfigError as exc:
            raise invalid_request(f"{exc}.", param="prices") from None
    served = await register_adapter(request.app[STATE], request.match_info["name"],
                                    body["name"], body["path"], prices)
    return web.json_response({**deployment_json(served), "parent": served.spec.parent},
                             status=201)


async def unregister(request: web.Request) -> web.Response:
    admin_of(request)
    base, name = request.match_info["name"], request.match_info["adapter"]
    await unregister_adapter(request.app[STATE], base, name)
    return web.json_response({"deleted": True, "name": f"{base}:{name}"})


def add_lora_routes(app: web.Application) -> None:
    app.router.add_post(PATH, register)
    app.router.add_delete(PATH + "/{adapter}", unregister)
