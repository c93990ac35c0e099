"""`GET /v1/requests/{id}`: one finished request as the gateway recorded it; and
`GET /admin/v1/requests?lane=&org_id=&limit=`: the latest records, for an admin key.

The timeline (stage ms), token counts, cache hit, model, deployment, replica (its
address: admin keys only), status, finish reason, cost and time, every candidate a
request with fallbacks tried, plus the redacted bodies when its org captures them. A key
of the request's org may read it, and an admin key any; for anyone else, and for an id
that is unknown or past the retention window, the answer is the same 404, so an id does
not tell whether it exists. The record is written off the request path, but a request
just finished is found at once (the gateway looks in its queue first). Each record names
its lane: `live`, `batch` (a Batch API line) or `background` (a background response);
the admin listing shows every org's, newest first, filtered by `lane` and `org_id`.
"""

from __future__ import annotations

from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel

from tokenyard.api.admin import admin_of
from tokenyard.api.context import KEY, STATE
from tokenyard.api.respond import json_response
from tokenyard.errors import invalid_request, not_found
from tokenyard.telemetry.request_log import LANES


class RequestTokens(BaseModel):
    prompt: int  # every prompt token, cached ones included
    cached: int
    output: int


class RequestCost(BaseModel):
    currency: str
    total: str  # what the ledger charged, a decimal string


class RequestCapture(BaseModel):
    request: Any  # the redacted body: JSON, or text when cut
    response: Any  # None: the request failed or was cancelled
    truncated: bool
    expires_at: str


class RequestAttempt(BaseModel):
    """One candidate a request with fallbacks tried (gateway/fallbacks.py)."""

    model: str  # the name tried: a deployment or an alias
    deployment: str | None  # where it routed; None: not that far
    outcome: Literal["served", "failed", "skipped"]
    error_code: str | None  # what ended or skipped it


class RequestRecordObject(BaseModel):
    """The answer of `GET /v1/requests/{id}` (its shape in /openapi.json)."""

    id: str
    object: Literal["request"] = "request"
    created_at: str
    org_id: str | None
    project_id: str | None
    user_id: str | None  # the user the key belongs to
    key_prefix: str | None
    endpoint: str
    model: str | None
    deployment: str | None
    region: str | None = None  # the deployment's; None: it declares none
    replica: str | None
    status: int  # HTTP; 499: the client went away
    error_code: str | None
    finish_reason: str | None
    stream: bool
    tokens: RequestTokens
    cache_hit: bool
    cost: RequestCost | None
    timeline: dict[str, float]  # stage → ms
    duration_ms: float
    #: A request with fallbacks: each candidate tried, in order (None: it had none).
    attempts: list[RequestAttempt] | None = None
    #: Where it came from: a live request, a Batch API line, a background response.
    lane: Literal["live", "batch", "background"] = "live"
    capture: RequestCapture | None


async def get_request(request: web.Request) -> web.Response:
    gateway = request.app[STATE].gateway
    if gateway is None:
        raise not_found("Request records need the gateway: this server runs with --no-auth.")
    request_id = request.match_info["request_id"]
    found = await gateway.requests.find(request_id, request[KEY])
    if found is None:
        raise not_found(f"No request found with id '{request_id}'.")
    return json_response(RequestRecordObject.model_validate(found))


class RequestRecordList(BaseModel):
    """The answer of `GET /admin/v1/requests`: the latest records first."""

    data: list[RequestRecordObject]


async def list_requests(request: web.Request) -> web.Response:
    """GET /admin/v1/requests: the latest request records (`limit`, default 100, at most
    1000) of every org or of `org_id`, of every lane or of `lane`."""
    admin = admin_of(request)
    query = request.query
    lane = query.get("lane")
    if lane is not None and lane not in LANES:
        raise invalid_request(f"lane must be one of {', '.join(LANES)}.", param="lane")
    try:
        limit = int(query.get("limit", "100"))
    except ValueError:
        limit = -1
    if not 1 <= limit <= 1000:
        raise invalid_request("limit must be a whole number from 1 to 1000.", param="limit")
    found = await admin.requests.listed(lane=lane, org_id=query.get("org_id"), limit=limit)
    return json_response(RequestRecordList.model_validate({"data": found}))


def add_request_routes(app: web.Application) -> None:
    app.router.add_get("/v1/requests/{request_id}", get_request)
    app.router.add_get("/admin/v1/requests", list_requests)
