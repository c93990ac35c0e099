"""`/admin/v1/…`: the administrative operations over HTTP, for keys with the admin scope.

    POST /admin/v1/orgs                      {name, balance?, rpm?, tpm?, max_concurrency?,
                                              free_tier_daily_requests?, priority?}
    GET  /admin/v1/orgs
    POST /admin/v1/orgs/{org_id}/projects    {name}
    POST /admin/v1/orgs/{org_id}/limits      {rpm?, tpm?, max_concurrency?,
                                              free_tier_daily_requests?,
                                              batch_enqueued_tokens?} (replaces all)
    POST /admin/v1/orgs/{org_id}/priority    {priority: high|normal|low}
    POST /admin/v1/orgs/{org_id}/credit      {amount}
    POST /admin/v1/orgs/{org_id}/spend_cap   {cap (null: none), project_id?}
    POST /admin/v1/orgs/{org_id}/capture     {enabled?: bool (default true),
                                              retention_days? (default 7)}
    GET  /admin/v1/orgs/{org_id}/capture
    POST /admin/v1/orgs/{org_id}/regions     {allowed_regions: [names] | null (any)}
    POST /admin/v1/projects/{project_id}/regions  {allowed_regions: [names] | null (the
                                              org's); within the org's (gateway/region_admin)
    POST /admin/v1/users                     {org_id, email, name?, project_id?,
                                              monthly_budget?, total_budget?}
    GET  /admin/v1/users?org_id=
    POST /admin/v1/users/{user_id}/budget    {monthly_budget?, total_budget?} (replaces
                                              both; absent or null: none)
    POST /admin/v1/keys                      {org_id, name?, project_id?, user_id?, models?,
                                              max_context_tokens?, admin?: bool, rpm?, tpm?,
                                              max_concurrency?, expires_at?, priority?,
                                              monthly_budget?, total_budget?}
                                              → the secret, once
    GET  /admin/v1/keys?org_id=
    POST /admin/v1/keys/{key_id}/revoke
    POST /admin/v1/keys/{key_id}/limits      {rpm?, tpm?, max_concurrency?}
    POST /admin/v1/keys/{key_id}/priority    {priority: high|normal|low|org (null: org)}
    POST /admin/v1/keys/{key_id}/budget      {monthly_budget?, total_budget?} (as a user's)
    GET  /admin/v1/budgets?org_id=           every key's and user's budget, with its spend
    PUT  /admin/v1/prices/{model}            {input, cached_input, output}
    GET  /admin/v1/prices
    GET  /admin/v1/usage?group_by=key|user|project|org|model|day|batch&since=&until=&org_id=
                        &format=json|csv
    GET  /admin/v1/shadow/report?alias=&since=   per (alias, primary, shadow): count,
                        text match rate, p50 latencies and their ratio, mean output tokens

A bool is a JSON true or false: anything else ("false", 0, 1, "yes") is a 400 naming
the field, and null counts as leaving it out only where that means false (`admin`, not
`enabled`). Money is a decimal string ("12.50"); prices are per million tokens. A
priority class orders the requests of a key or an org in the engine's scheduler: high
before normal (the default) before low; a key without its own follows its org's.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from tokenyard.errors import APIError, invalid_request
from tokenyard.gateway import admin_users as users
from tokenyard.gateway.admin import Admin, AdminError, to_csv
from tokenyard.gateway.region_admin import set_org_regions, set_project_regions

#: Resolves a request to the Admin over its gateway's store, or raises (401/403/404).
AdminOf = Callable[[web.Request], Admin]
_ADMIN_OF: web.AppKey[AdminOf] = web.AppKey("admin_of")


def _reply(value: Any, status: int = 200) -> web.Response:
    return web.json_response({"data": value} if isinstance(value, list) else value,
                             status=status)


async def request_args(request: web.Request) -> dict[str, Any]:
    """The body of an admin request, a JSON object (its route's schema has held it,
    `api/admin_schemas.py`)."""
    raw = await request.read()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise invalid_request("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body


def admin_of(request: web.Request) -> Admin:
    """The Admin of an admin-scoped request (raises 401/403/404 otherwise), for routes
    registered elsewhere (`api/fleet_admin.py`)."""
    return request.app[_ADMIN_OF](request)


def refusal(exc: AdminError) -> APIError:
    """An admin operation's refusal as the API's error: 400, or 404 for what is not there."""
    message = str(exc)
    return APIError(exc.status, message if message.endswith(".") else f"{message}.",
                    param=exc.field, code="not_found" if exc.status == 404 else None)


Handler = Callable[[Admin, web.Request], Awaitable[Any]]


def _route(handler: Handler, status: int = 200) -> Callable[[web.Request], Awaitable[Any]]:
    async def run(request: web.Request) -> web.Response:
        admin = request.app[_ADMIN_OF](request)
        try:
            result = await handler(admin, request)
        except AdminError as exc:
            raise refusal(exc) from None
        return result if isinstance(result, web.Response) else _reply(result, status)

    return run


async def _usage(admin: Admin, request: web.Request) -> Any:
    rows = await admin.usage(dict(request.query))
    if request.query.get("format") == "csv":
        return web.Response(text=to_csv(rows), content_type="text/csv")
    return rows


def add_admin_routes(app: web.Application, admin_of: AdminOf) -> None:
    """Register `/admin/v1/…` on `app`; `admin_of` authorizes each call."""
    app[_ADMIN_OF] = admin_of
    m = "org_id"
    routes: list[tuple[str, str, Handler, int]] = [
        ("POST", "/admin/v1/orgs", lambda a, r: _with_args(r, a.create_org), 201),
        ("GET", "/admin/v1/orgs", lambda a, r: a.list_orgs(), 200),
        ("POST", "/admin/v1/orgs/{org_id}/projects",
         lambda a, r: _with_args(r, lambda x: a.create_project(r.match_info[m], x)), 201),
        ("POST", "/admin/v1/orgs/{org_id}/limits",
         lambda a, r: _with_args(r, lambda x: a.set_org_limits(r.match_info[m], x)), 200),
        ("POST", "/admin/v1/orgs/{org_id}/priority",
         lambda a, r: _with_args(r, lambda x: a.set_org_priority(r.match_info[m], x)), 200),
        ("POST", "/admin/v1/orgs/{org_id}/credit",
         lambda a, r: _with_args(r, lambda x: a.add_credit(r.match_info[m], x)), 200),
        ("POST", "/admin/v1/orgs/{org_id}/spend_cap",
         lambda a, r: _with_args(r, lambda x: a.set_spend_cap(r.match_info[m], x)), 200),
        ("POST", "/admin/v1/orgs/{org_id}/capture",
         lambda a, r: _with_args(r, lambda x: a.set_capture(r.match_info[m], x)), 200),
        ("GET", "/admin/v1/orgs/{org_id}/capture", lambda a, r: a.capture(r.match_info[m]),
         200),
        ("POST", "/admin/v1/orgs/{org_id}/regions", lambda a, r: _with_args(
            r, lambda x: set_org_regions(a.store, r.match_info[m], x)), 200),
        ("POST", "/admin/v1/projects/{project_id}/regions", lambda a, r: _with_args(
            r, lambda x: set_project_regions(a.store, r.match_info["project_id"], x)), 200),
        ("POST", "/admin/v1/keys", lambda a, r: _with_args(r, a.create_key), 201),
        ("GET", "/admin/v1/keys", lambda a, r: a.list_keys(r.query.get("org_id")), 200),
        ("POST", "/admin/v1/keys/{key_id}/revoke",
         lambda a, r: a.revoke_key(r.match_info["key_id"]), 200),
        ("POST", "/admin/v1/keys/{key_id}/limits",
         lambda a, r: _with_args(r, lambda x: a.set_key_limits(r.match_info["key_id"], x)),
         200),
        ("POST", "/admin/v1/keys/{key_id}/priority",
         lambda a, r: _with_args(r, lambda x: a.set_key_priority(r.match_info["key_id"], x)),
         200),
        ("POST", "/admin/v1/keys/{key_id}/budget", lambda a, r: _with_args(
            r, lambda x: users.set_budget(a, "key", r.match_info["key_id"], x)), 200),
        ("POST", "/admin/v1/users", lambda a, r: _with_args(
            r, lambda x: users.create_user(a, x)), 201),
        ("GET", "/admin/v1/users", lambda a, r: users.list_users(a, r.query.get("org_id")),
         200),
        ("POST", "/admin/v1/users/{user_id}/budget", lambda a, r: _with_args(
            r, lambda x: users.set_budget(a, "user", r.match_info["user_id"], x)), 200),
        ("GET", "/admin/v1/budgets", lambda a, r: users.budgets(a, r.query.get("org_id")),
         200),
        ("PUT", "/admin/v1/prices/{model}",
         lambda a, r: _with_args(r, lambda x: a.set_price(r.match_info["model"], x)), 200),
        ("GET", "/admin/v1/prices", lambda a, r: a.list_prices(), 200),
        ("GET", "/admin/v1/usage", _usage, 200),
        ("GET", "/admin/v1/shadow/report", lambda a, r: a.shadow_report(dict(r.query)), 200),
    ]
    for method, path, handler, status in routes:
        app.router.add_route(method, path, _route(handler, status))


async def _with_args(
    request: web.Request, operation: Callable[[dict[str, Any]], Awaitable[Any]]
) -> Any:
    return await operation(await request_args(request))
