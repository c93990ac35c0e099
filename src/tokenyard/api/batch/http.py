"""What the OpenAI and Anthropic batch routes share over HTTP: the store's batches and
the calling key, a JSON body, a batch of the caller's org or the dialect's 404, a list
page, and a time as OpenAI's Unix seconds."""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from aiohttp import web

from tokenyard.api.context import KEY
from tokenyard.errors import APIError, invalid_request, not_found
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.batches import Batches, BatchRecord

BATCHES: web.AppKey[Batches] = web.AppKey("tokenyard_batches", Batches)

T = TypeVar("T")


def epoch(value: datetime | None) -> int | None:
    """A stored time as Unix seconds (None stays None)."""
    return None if value is None else int(value.timestamp())


def batches_of(request: web.Request) -> tuple[Batches, KeyContext]:
    """The batches and the calling key; 404 without a gateway (nothing is stored)."""
    batches = request.app.get(BATCHES)
    if batches is None or KEY not in request:
        raise not_found("The Batch API needs the gateway's store: this server runs with "
                        "--no-auth.")
    return batches, request[KEY]


async def json_body(request: web.Request) -> Any:
    """The request's body as JSON (400 if it is not)."""
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise invalid_request("The body is not valid JSON.") from None


async def found_batch(request: web.Request, dialect: str, missing: Callable[[str], APIError],
                      ) -> tuple[Batches, KeyContext, BatchRecord]:
    """The batch `{batch_id}` of the caller's org in `dialect`, else `missing(id)`."""
    batches, key = batches_of(request)
    batch_id = request.match_info["batch_id"]
    record = await batches.get(key, batch_id, dialect)
    if record is None:
        raise missing(batch_id)
    return batches, key, record


async def page(found: Sequence[T], limit: int,
               render: Callable[[T], dict[str, Any] | Awaitable[dict[str, Any]]], *,
               from_end: bool = False, **fields: Any) -> dict[str, Any]:
    """A list page of `found` (read with `limit + 1`: one more says there is more): its
    first `limit` items rendered (`from_end`: its last, a page before a cursor), with
    `has_more`, `first_id`, `last_id` and `fields` (OpenAI's `object: "list"`)."""
    kept = found[-limit:] if from_end else found[:limit]
    data = []
    for item in kept:
        body = render(item)
        data.append(await body if inspect.isawaitable(body) else body)
    return {**fields, "data": data, "has_more": len(found) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
