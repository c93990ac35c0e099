"""Stored responses over HTTP, and the two calls `POST /v1/responses` makes of them.

    GET    /v1/responses/{id}               the response object as it was returned
    DELETE /v1/responses/{id}               → {"id", "object": "response.deleted", "deleted"}
    GET    /v1/responses/{id}/input_items   ?limit=1..100 (20) &order=asc|desc (desc)
                                            &after=&before= → an OpenAI list object

(The first two are routed through `background.py`, which finds a background response
first; a background response is among these once it has ended: completed or incomplete.)
`expand_previous` turns a `previous_response_id` into the conversation so far;
`remember` stores a finished response. A key reaches its own org's responses (an admin
key, every org's); another org's, an unknown, a deleted or an expired id is "not found"
alike, so ids of other orgs cannot be probed. Without a gateway (`serve --no-auth`) there
is no store: nothing is remembered and nothing can be found.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tokenyard.api.context import KEY, STATE
from tokenyard.api.respond import json_response
from tokenyard.api.schemas import page_limit
from tokenyard.errors import APIError, invalid_request
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.responses import (
    ChainTooLong,
    ResponseNotFound,
    StoredResponses,
    UnknownItem,
    page,
)

#: input_items' page size: default and bounds.
DEFAULT_LIMIT, MAX_LIMIT = 20, 100
NO_STORE = ("this server runs without its store (--no-auth), so no response is stored")


def _responses(request: web.Request) -> StoredResponses | None:
    gateway = request.app[STATE].gateway
    return None if gateway is None else gateway.responses


def not_found(response_id: str, responses: object | None) -> APIError:
    """404 in OpenAI's words; without a store (`responses` None), it says why."""
    why = f": {NO_STORE}" if responses is None else ""
    return APIError(404, f"No response found with id '{response_id}'{why}.",
                    type="invalid_request_error", code="not_found")


async def expand_previous(request: web.Request,
                          previous_response_id: str) -> list[dict[str, Any]]:
    """The conversation up to `previous_response_id` as Responses input items, oldest
    turn first: each turn's input items, then its output items. 400 if the response (or
    one it continues) cannot be found by this key, or the chain is absurdly long."""
    return await expand_with(_responses(request), request.get(KEY), previous_response_id)


async def expand_with(responses: StoredResponses | None, key: KeyContext | None,
                      previous_response_id: str) -> list[dict[str, Any]]:
    """`expand_previous` for `key` over `responses` (a caller without HTTP: a batch);
    without a store (`--no-auth`: no key either) nothing can be continued."""
    if responses is None or key is None:
        raise invalid_request(
            f"'previous_response_id' needs stored responses, but {NO_STORE}.",
            param="previous_response_id", code="previous_response_not_found")
    try:
        return await responses.conversation(key, previous_response_id)
    except ResponseNotFound as missing:
        raise invalid_request(
            f"Previous response with id '{missing.response_id}' not found.",
            param="previous_response_id", code="previous_response_not_found") from None
    except ChainTooLong as exc:
        raise invalid_request(f"Invalid 'previous_response_id': {exc}.",
                              param="previous_response_id") from None


async def remember(request: web.Request, response: dict[str, Any],
                   input_items: list[dict[str, Any]]) -> None:
    """Store the finished `response` (as returned to the client) and its turn's input
    items for the request's key; nothing without a gateway."""
    responses = _responses(request)
    if responses is not None:
        await responses.save(request[KEY], response, input_items)


async def retrieve(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}."""
    response_id = request.match_info["response_id"]
    responses = _responses(request)
    found = None if responses is None else await responses.get(request[KEY], response_id)
    if found is None:
        raise not_found(response_id, responses)
    return json_response(found.response)


async def delete(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id}."""
    response_id = request.match_info["response_id"]
    responses = _responses(request)
    if responses is None or not await responses.delete(request[KEY], response_id):
        raise not_found(response_id, responses)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def input_items(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}/input_items: one page of the response's own input items."""
    response_id = request.match_info["response_id"]
    query = request.query
    limit, order = paging(query)
    responses = _responses(request)
    found = None if responses is None else await responses.get(request[KEY], response_id)
    if found is None:
        raise not_found(response_id, responses)
    try:
        data, has_more = page(found.input_items, limit=limit, order=order,
                              after=query.get("after"), before=query.get("before"))
    except UnknownItem as unknown:
        raise invalid_request(
            f"Invalid '{unknown.param}': response '{response_id}' has no input item "
            f"'{unknown.item_id}'.", param=unknown.param, code="invalid_value") from None
    return listing(data, has_more)


def paging(query: Any) -> tuple[int, str]:
    """A listing's `limit` (1..100, 20) and `order` ('asc' or 'desc', the default)."""
    limit = page_limit(query, DEFAULT_LIMIT, MAX_LIMIT)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_request(f"Invalid 'order': expected 'asc' or 'desc', got {order!r}.",
                              param="order", code="invalid_value")
    return limit, order


def listing(data: list[dict[str, Any]], has_more: bool) -> web.Response:
    """An OpenAI list object of items."""
    return json_response({
        "object": "list", "data": data,
        "first_id": data[0].get("id") if data else None,
        "last_id": data[-1].get("id") if data else None,
        "has_more": has_more,
    })


def add_stored_response_routes(app: web.Application) -> None:
    """GET /v1/responses/{id}/input_items (GET and DELETE /v1/responses/{id} are
    `background.py`'s: they find background responses too)."""
    app.router.add_get("/v1/responses/{response_id}/input_items", input_items)
