"""The request schema of every `/admin/v1` route, and the middleware that holds each
admin request to its route's schema before the route runs.

A field the schema does not name is a 400 naming it (`extra="forbid"`): an admin call
that seemed to set something it did not is worse than a refusal. Bodies are checked for
POST and PUT, query parameters for GET. The schemas are listed in `/openapi.json`
(`api/openapi.py`); an `/admin/` route without one answers 500 with a log line, and a
test walks the router so that none ships without one. The admin layer
(`gateway/admin.py`) still checks what a schema cannot say (an org exists, a priority
class's name); a schema checks names and JSON types.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, ClassVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from tokenyard.api.context import KEY, STATE
from tokenyard.errors import APIError, invalid_request
from tokenyard.gateway.auth import require_admin

logger = logging.getLogger(__name__)

PREFIX = "/admin/"

Count = Annotated[int, Field(ge=0, description="a whole number >= 0; null: none")]
Money = Annotated[str | int, Field(description='a decimal amount, "12.50"')]
Name = Annotated[str, Field(min_length=1)]


class _Forbid(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: What a 400 for an unknown field says after naming it.
    unknown_hint: ClassVar[str] = "this route does not take it."


class Empty(_Forbid):
    """No fields."""


class OrgIdQuery(_Forbid):
    org_id: str | None = None


class KeyLimits(_Forbid):
    rpm: Count | None = None
    tpm: Count | None = None
    max_concurrency: Count | None = None


class CreateOrg(KeyLimits):
    name: Name
    balance: Money | None = None
    free_tier_daily_requests: Count | None = None
    priority: str | None = Field(None, description="high, normal (default) or low")


class CreateProject(_Forbid):
    name: Name


class OrgLimits(KeyLimits):
    free_tier_daily_requests: Count | None = None
    batch_enqueued_tokens: Count | None = None


class OrgPriority(_Forbid):
    priority: str = Field(description="high, normal or low")


class KeyPriority(_Forbid):
    priority: str | None = Field(description='high, normal, low, or "org"/null: the org\'s')


class Credit(_Forbid):
    amount: Money


class SpendCap(_Forbid):
    cap: Money | None = Field(description="per UTC calendar month; null: none")
    project_id: str | None = Field(None, description="one of the org's projects; "
                                                     "absent: the whole org")


class Capture(_Forbid):
    enabled: StrictBool = True
    retention_days: Count | None = None


class Regions(_Forbid):
    allowed_regions: list[str] | None = Field(description="region names; null: any")


class Budget(_Forbid):
    monthly_budget: Money | None = None
    total_budget: Money | None = None


class CreateUser(Budget):
    org_id: Name
    email: Name
    name: str | None = None
    project_id: str | None = None


class KeyScopes(_Forbid):
    """The `scopes` object a key is listed with, accepted back when a key is created."""

    models: list[str] | None = Field(None, description="model names or globs; "
                                                       "empty or null: every model")
    max_context_tokens: Count | None = None
    admin: StrictBool | None = None


class CreateKey(Budget, KeyLimits):
    org_id: Name
    name: str | None = None
    project_id: str | None = None
    user_id: str | None = None
    models: list[str] | str | None = Field(None, description="names or globs (a list, or "
                                                            "a comma-separated string)")
    max_context_tokens: Count | None = None
    admin: StrictBool | None = None
    scopes: KeyScopes | None = Field(None, description="as a key is listed; its fields "
                                                       "may not also be given at the top")
    expires_at: str | None = Field(None, description="ISO 8601 date or time")
    priority: str | None = None


class Price(_Forbid):
    model: str | None = Field(None, description="as prices are listed; if given, the "
                                                "path's model")
    input: Money | None = None
    cached_input: Money | None = None
    output: Money | None = None


class UsageQuery(OrgIdQuery):
    group_by: str | None = None
    since: str | None = None
    until: str | None = None
    format: str | None = Field(None, description="json (default) or csv")


class ShadowQuery(_Forbid):
    alias: str | None = None
    since: str | None = None


class AdapterPrices(_Forbid):
    input: Money | None = None
    cached_input: Money | None = None
    output: Money | None = None


class RegisterAdapter(_Forbid):
    name: Name = Field(description="the adapter's name: requests use {deployment}:{name}")
    path: Name = Field(description="its PEFT folder on the replicas' hosts")
    prices: AdapterPrices | None = Field(None, description="per 1M tokens; default: the "
                                                           "deployment's")


class Drain(_Forbid):
    deployment: str
    replica: str
    drain: StrictBool = True


class Scale(_Forbid):
    replicas: StrictInt


class OrgModeration(_Forbid):
    # Never dropped without a word: a blocklist sent here would seem to be in force.
    unknown_hint: ClassVar[str] = (
        "an org's moderation policy sets 'input' and 'output'; a classifier and its "
        "blocklist patterns belong to a deployment, in the fleet file's moderation table.")
    input: str | None = Field(None, description="off, flag or block")
    output: str | None = Field(None, description="off, flag or block")


class ModerationEventsQuery(OrgIdQuery):
    limit: str | None = Field(None, description="a whole number (default 100)")


class RequestsQuery(OrgIdQuery):
    lane: str | None = Field(None, description="live, batch or background; none: every lane")
    limit: str | None = Field(None, description="1-1000 (default 100)")


class DashboardQuery(_Forbid):
    recent: str | None = Field(None, description="0-200 (default 30)")
    lane: str | None = Field(None, description="live (default) or batch")


class McpServer(_Forbid):
    label: str = Field(min_length=1, max_length=64)
    url: str = Field(min_length=1, max_length=2048, description="http(s) URL")
    headers: dict[str, str] | None = Field(None, description="sent with every call: its "
                                           "secrets, never shown again")
    allowed_tools: list[str] | None = Field(None, description="null: every tool it lists")
    require_approval: str | None = Field(None, description="always, never; null: the "
                                         "request's rule")
    description: str | None = None


class McpGrant(_Forbid):
    key_id: str | None = None
    project_id: str | None = None
    tools: list[str] | None = Field(None, description="null: every tool it offers")


#: (method, path) → the schema of its body (POST, PUT) or query (GET).
SCHEMAS: dict[tuple[str, str], type[BaseModel]] = {
    ("POST", "/admin/v1/orgs"): CreateOrg,
    ("GET", "/admin/v1/orgs"): Empty,
    ("POST", "/admin/v1/orgs/{org_id}/projects"): CreateProject,
    ("POST", "/admin/v1/orgs/{org_id}/limits"): OrgLimits,
    ("POST", "/admin/v1/orgs/{org_id}/priority"): OrgPriority,
    ("POST", "/admin/v1/orgs/{org_id}/credit"): Credit,
    ("POST", "/admin/v1/orgs/{org_id}/spend_cap"): SpendCap,
    ("POST", "/admin/v1/orgs/{org_id}/capture"): Capture,
    ("GET", "/admin/v1/orgs/{org_id}/capture"): Empty,
    ("POST", "/admin/v1/orgs/{org_id}/regions"): Regions,
    ("POST", "/admin/v1/orgs/{org_id}/moderation"): OrgModeration,
    ("POST", "/admin/v1/projects/{project_id}/regions"): Regions,
    ("POST", "/admin/v1/keys"): CreateKey,
    ("GET", "/admin/v1/keys"): OrgIdQuery,
    ("POST", "/admin/v1/keys/{key_id}/revoke"): Empty,
    ("POST", "/admin/v1/keys/{key_id}/limits"): KeyLimits,
    ("POST", "/admin/v1/keys/{key_id}/priority"): KeyPriority,
    ("POST", "/admin/v1/keys/{key_id}/budget"): Budget,
    ("POST", "/admin/v1/users"): CreateUser,
    ("GET", "/admin/v1/users"): OrgIdQuery,
    ("POST", "/admin/v1/users/{user_id}/budget"): Budget,
    ("GET", "/admin/v1/budgets"): OrgIdQuery,
    ("PUT", "/admin/v1/prices/{model}"): Price,
    ("GET", "/admin/v1/prices"): Empty,
    ("GET", "/admin/v1/usage"): UsageQuery,
    ("GET", "/admin/v1/shadow/report"): ShadowQuery,
    ("GET", "/admin/v1/deployments"): Empty,
    ("POST", "/admin/v1/replicas/drain"): Drain,
    ("GET", "/admin/v1/deployments/{name}/replicas"): Empty,
    ("POST", "/admin/v1/deployments/{name}/replicas"): Scale,
    ("POST", "/admin/v1/deployments/{name}/adapters"): RegisterAdapter,
    ("DELETE", "/admin/v1/deployments/{name}/adapters/{adapter}"): Empty,
    ("GET", "/admin/v1/models"): Empty,
    ("POST", "/admin/v1/models/{name}/load"): Empty,
    ("POST", "/admin/v1/models/{name}/unload"): Empty,
    ("POST", "/admin/v1/models/{name}/pin"): Empty,
    ("POST", "/admin/v1/models/{name}/unpin"): Empty,
    ("GET", "/admin/v1/moderation/events"): ModerationEventsQuery,
    ("GET", "/admin/v1/dashboard"): DashboardQuery,
    ("GET", "/admin/v1/requests"): RequestsQuery,
    ("POST", "/admin/v1/orgs/{org_id}/mcp_servers"): McpServer,
    ("GET", "/admin/v1/orgs/{org_id}/mcp_servers"): Empty,
    ("DELETE", "/admin/v1/mcp_servers/{server_id}"): Empty,
    ("POST", "/admin/v1/mcp_servers/{server_id}/grants"): McpGrant,
}


def _message(schema: type[BaseModel], error: Any) -> str:
    field = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"Unknown field {field!r}: {getattr(schema, 'unknown_hint', '')}"
    if error["type"] == "bool_type":
        return f"{field} must be a JSON boolean, true or false."
    return f"{field}: {error['msg']}." if field else f"{error['msg']}."


def check(schema: type[BaseModel], args: Any) -> None:
    """Hold `args` to `schema`: a 400 naming the first field at fault otherwise."""
    if not isinstance(args, dict):
        raise invalid_request("The request body must be a JSON object.")
    try:
        schema.model_validate(args)
    except ValidationError as exc:
        # An unknown field first: it says most about what the caller got wrong.
        error = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
        raise invalid_request(_message(schema, error), param=".".join(
            str(part) for part in error["loc"]) or None) from None


async def _args(request: web.Request) -> Any:
    if request.method == "GET":
        return dict(request.query)
    raw = await request.read()  # cached: the route reads it again
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        raise invalid_request("The request body is not valid JSON.") from None


#: The methods whose requests are checked (a preflight or HEAD carries no arguments).
CHECKED = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def admin_schema_middleware(request: web.Request,
                                  handler: Handler) -> web.StreamResponse:
    """Every `/admin/` request: the admin scope first (a key without it learns nothing of
    the schemas), then its route's schema."""
    route = request.match_info.route
    path = route.resource.canonical if route.resource is not None else ""
    if not path.startswith(PREFIX) or request.method not in CHECKED:
        return await handler(request)
    if request.app[STATE].gateway is not None:
        require_admin(request[KEY])
    schema = SCHEMAS.get((request.method, path))
    if schema is None:
        logger.error("admin route %s %s has no request schema", request.method, path)
        raise APIError(500, f"{request.method} {path} has no request schema.")
    check(schema, await _args(request))
    return await handler(request)
