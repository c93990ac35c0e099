"""What the OpenAI and Anthropic batch routes share over HTTP: the store's batches and
the calling key, a JSON body, and a batch of the caller's org or the dialect's 404."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from tokenyard.api.context import KEY
from tokenyard.errors import APIError, invalid_request, not_found
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.batches import Batches, BatchRecord

BATCHES: web.AppKey[Batches] = web.AppKey("tokenyard_batches", Batches)


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
