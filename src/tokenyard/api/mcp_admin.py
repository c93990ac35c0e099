"""`/admin/v1/…` of the MCP registry (`gateway/mcp_registry.py`), admin scope required:

    POST   /admin/v1/orgs/{org_id}/mcp_servers       register a server → 201
    GET    /admin/v1/orgs/{org_id}/mcp_servers       the org's servers (header names only)
    DELETE /admin/v1/mcp_servers/{server_id}
    POST   /admin/v1/mcp_servers/{server_id}/grants  {key_id | project_id, tools?}
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from tokenyard.api.admin import admin_of, refusal, request_args
from tokenyard.gateway import mcp_registry as registry
from tokenyard.gateway.admin import AdminError


def _route(operation: Callable[[web.Request], Awaitable[Any]], status: int = 200
           ) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def run(request: web.Request) -> web.Response:
        admin_of(request)  # 401/403 before anything
        try:
            result = await operation(request)
        except AdminError as exc:
            raise refusal(exc) from None
        return web.json_response({"data": result} if isinstance(result, list) else result,
                                 status=status)

    return run


def add_mcp_admin_routes(app: web.Application) -> None:
    """The registry's admin routes on `app`."""

    async def create(request: web.Request) -> Any:
        return await registry.register_server(admin_of(request).store,
                                              request.match_info["org_id"],
                                              await request_args(request))

    async def listing(request: web.Request) -> Any:
        return await registry.list_servers(admin_of(request).store,
                                           request.match_info["org_id"])

    async def remove(request: web.Request) -> Any:
        return await registry.remove_server(admin_of(request).store,
                                            request.match_info["server_id"])

    async def grant(request: web.Request) -> Any:
        return await registry.grant(admin_of(request).store,
                                    request.match_info["server_id"],
                                    await request_args(request))

    servers = "/admin/v1/orgs/{org_id}/mcp_servers"
    app.router.add_post(servers, _route(create, 201))
    app.router.add_get(servers, _route(listing))
    app.router.add_delete("/admin/v1/mcp_servers/{server_id}", _route(remove))
    app.router.add_post("/admin/v1/mcp_servers/{server_id}/grants", _route(grant))
