"""The Conversations API over HTTP, and the two calls `POST /v1/responses` makes of it
(`conversation`: the items so far, then the turn's input and output items appended).

    POST   /v1/conversations                      {metadata?, items?} → conversation
    GET    /v1/conversations/{id}                 → conversation
    POST   /v1/conversations/{id}                 {metadata} → conversation
    DELETE /v1/conversations/{id}                 → conversation.deleted
    GET    /v1/conversations/{id}/items           ?limit&order&after → list
    POST   /v1/conversations/{id}/items           {items} → list of the added items
    GET    /v1/conversations/{id}/items/{item}    → the item
    DELETE /v1/conversations/{id}/items/{item}    → the conversation

Another org's, unknown or deleted conversations are "not found" alike. Without a gateway
(`serve --no-auth`) there is no store, and every route answers 404 saying so.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tokenyard.api.context import KEY, STATE
from tokenyard.api.respond import json_response
from tokenyard.api.responses.convert import items_json, parse_items
from tokenyard.api.responses.stored import NO_STORE, listing, paging
from tokenyard.errors import APIError, invalid_request
from tokenyard.gateway.conversations import Conversations, conversation_object
from tokenyard.gateway.responses import UnknownItem, page

#: The most items one create or add may carry (OpenAI's limit), and metadata's bounds.
MAX_NEW_ITEMS, MAX_METADATA, MAX_VALUE = 20, 16, 512


def _conversations(request: web.Request) -> Conversations:
    gateway = request.app[STATE].gateway
    if gateway is None:
        raise APIError(404, f"Conversations are unavailable: {NO_STORE}.",
                       type="invalid_request_error", code="not_found")
    return Conversations(gateway.responses.store, region=gateway.responses.region)


def _not_found(conversation_id: str) -> APIError:
    return APIError(404, f"Conversation with id '{conversation_id}' not found.",
                    type="invalid_request_error", code="not_found")


def conversation_id(value: Any) -> str:
    """The id in a request's `conversation` (a string, or an object with `id`)."""
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise invalid_request("'conversation' must be a conversation id or an object with "
                              "its 'id'.", param="conversation", code="invalid_value")
    return value


async def items_of(request: web.Request, conversation: str) -> list[dict[str, Any]]:
    """The conversation's items so far, for a response continuing it (400 if unknown)."""
    found = await _conversations(request).get(request[KEY], conversation)
    if found is None:
        raise invalid_request(f"Conversation with id '{conversation}' not found.",
                              param="conversation", code="not_found")
    return found.items


async def append(request: web.Request, conversation: str,
                 items: list[dict[str, Any]]) -> None:
    """Append a finished turn's input and output items to the conversation."""
    await _conversations(request).add_items(request[KEY], conversation, items)


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise invalid_request("The body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise invalid_request("The body must be a JSON object.")
    return body


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    metadata = body.get("metadata") or {}
    if (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str)
                       and len(v) <= MAX_VALUE for k, v in metadata.items())):
        raise invalid_request(f"'metadata' must be an object of at most {MAX_METADATA} "
                              f"string values (keys up to 64, values up to {MAX_VALUE} "
                              "characters).", param="metadata", code="invalid_value")
    return metadata


def _items(body: dict[str, Any], required: bool) -> list[dict[str, Any]]:
    items = body.get("items")
    if items is None and not required:
        return []
    if not isinstance(items, list) or len(items) > MAX_NEW_ITEMS or (required and not items):
        raise invalid_request(f"'items' must be a list of 1 to {MAX_NEW_ITEMS} items.",
                              param="items", code="invalid_value")
    return items_json(parse_items(items))


async def create(request: web.Request) -> web.Response:
    body = await _body(request)
    made = await _conversations(request).create(request[KEY], _metadata(body),
                                                _items(body, required=False))
    return json_response(conversation_object(made))


async def retrieve(request: web.Request) -> web.Response:
    cid = request.match_info["conversation_id"]
    found = await _conversations(request).get(request[KEY], cid)
    if found is None:
        raise _not_found(cid)
    return json_response(conversation_object(found))


async def update(request: web.Request) -> web.Response:
    cid = request.match_info["conversation_id"]
    body = await _body(request)
    if "metadata" not in body:
        raise invalid_request("'metadata' is required.", param="metadata",
                              code="missing_required_parameter")
    changed = await _conversations(request).set_metadata(request[KEY], cid, _metadata(body))
    if changed is None:
        raise _not_found(cid)
    return json_response(conversation_object(changed))


async def delete(request: web.Request) -> web.Response:
    cid = request.match_info["conversation_id"]
    if not await _conversations(request).delete(request[KEY], cid):
        raise _not_found(cid)
    return json_response({"id": cid, "object": "conversation.deleted", "deleted": True})


async def list_items(request: web.Request) -> web.Response:
    cid = request.match_info["conversation_id"]
    query = request.query
    limit, order = paging(query)
    found = await _conversations(request).get(request[KEY], cid)
    if found is None:
        raise _not_found(cid)
    try:
        data, has_more = page(found.items, limit=limit, order=order, after=query.get("after"))
    except UnknownItem as unknown:
        raise invalid_request(f"Invalid 'after': conversation '{cid}' has no item "
                              f"'{unknown.item_id}'.", param="after",
                              code="invalid_value") from None
    return listing(data, has_more)


async def add_items(request: web.Request) -> web.Response:
    cid = request.match_info["conversation_id"]
    items = _items(await _body(request), required=True)
    added = await _conversations(request).add_items(request[KEY], cid, items)
    if added is None:
        raise _not_found(cid)
    return listing(added, False)


async def get_item(request: web.Request) -> web.Response:
    cid, item_id = request.match_info["conversation_id"], request.match_info["item_id"]
    found = await _conversations(request).get(request[KEY], cid)
    if found is None:
        raise _not_found(cid)
    for item in found.items:
        if item.get("id") == item_id:
            return json_response(item)
    raise APIError(404, f"Item with id '{item_id}' not found.",
                   type="invalid_request_error", code="not_found")


async def delete_item(request: web.Request) -> web.Response:
    cid, item_id = request.match_info["conversation_id"], request.match_info["item_id"]
    changed, held = await _conversations(request).delete_item(request[KEY], cid, item_id)
    if changed is None:
        raise _not_found(cid)
    if not held:
        raise APIError(404, f"Item with id '{item_id}' not found.",
                       type="invalid_request_error", code="not_found")
    return json_response(conversation_object(changed))


def add_conversation_routes(app: web.Application) -> None:
    """The Conversations API's routes on `app`."""
    app.router.add_post("/v1/conversations", create)
    app.router.add_get("/v1/conversations/{conversation_id}", retrieve)
    app.router.add_post("/v1/conversations/{conversation_id}", update)
    app.router.add_delete("/v1/conversations/{conversation_id}", delete)
    app.router.add_get("/v1/conversations/{conversation_id}/items", list_items)
    app.router.add_post("/v1/conversations/{conversation_id}/items", add_items)
    app.router.add_get("/v1/conversations/{conversation_id}/items/{item_id}", get_item)
    app.router.add_delete("/v1/conversations/{conversation_id}/items/{item_id}", delete_item)
