"""Anthropic's Message Batches, in Anthropic's shapes, on the same lane as OpenAI's.

    POST   /v1/messages/batches                        {requests: [{custom_id, params}]}
    GET    /v1/messages/batches                        ?limit &after_id &before_id
    GET    /v1/messages/batches/{id}
    POST   /v1/messages/batches/{id}/cancel
    DELETE /v1/messages/batches/{id}                   an ended batch
    GET    /v1/messages/batches/{id}/results           JSONL, once ended

Each request's `params` is checked as `POST /v1/messages` parses it, at creation (a 400
naming `requests.{i}.params…`), and runs as that route runs it (`api/batch/runner.py`).
A cancel cuts the requests in flight: each ends `canceled`, billed for what it
computed, as do those never run. A batch object is read from its one row.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from aiohttp import web

from tokenyard.api.batch.http import batches_of, found_batch, json_body, page
from tokenyard.api.batch.lines import check, estimate_tokens, model_of, sort_key
from tokenyard.api.errors import anthropic_error_body
from tokenyard.api.respond import json_response
from tokenyard.api.schemas import page_limit
from tokenyard.api.sse import to_json
from tokenyard.errors import APIError, invalid_request
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.batches import Batches, BatchRecord, Claimed, LineResult, NewLine

MAX_REQUESTS = 100_000
_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
ENDPOINT = "/v1/messages"


def _time(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat().replace("+00:00", "Z")


def _status(record: BatchRecord) -> str:
    return {"in_progress": "in_progress", "cancelling": "canceling"}.get(record.status,
                                                                          "ended")


def batch_object(request: web.Request, record: BatchRecord) -> dict[str, Any]:
    """The MessageBatch object of `record`."""
    status = _status(record)
    unrun = record.unended
    ended = status == "ended"
    return {
        "id": record.id, "type": "message_batch", "processing_status": status,
        "request_counts": {
            "processing": 0 if ended else unrun, "succeeded": record.succeeded,
            "errored": record.failed,
            "canceled": record.cancelled + (unrun if ended and record.status == "cancelled"
                                            else 0),
            "expired": unrun if ended and record.status == "expired" else 0},
        "ended_at": _time(record.ended_at), "created_at": _time(record.created_at),
        "expires_at": _time(record.expires_at), "archived_at": None,
        "cancel_initiated_at": _time(record.cancelling_at),
        "results_url": (f"{request.scheme}://{request.host}/v1/messages/batches/"
                        f"{record.id}/results" if ended else None),
    }


def _requests(body: Any) -> tuple[list[NewLine], int, str | None]:
    """The batch's lines, their estimated tokens and the model they name; 400 naming the
    first bad request."""
    if not isinstance(body, dict) or set(body) != {"requests"}:
        raise invalid_request("The body must be an object with only 'requests'.",
                              param="requests")
    items = body["requests"]
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_REQUESTS:
        raise invalid_request(f"'requests' must hold 1 to {MAX_REQUESTS} requests.",
                              param="requests")
    lines, tokens, seen = [], 0, set()
    for i, item in enumerate(items):
        where = f"requests.{i}"
        if not isinstance(item, dict) or set(item) != {"custom_id", "params"}:
            raise invalid_request(f"{where}: must be an object of 'custom_id' and "
                                  "'params'.", param=where)
        custom_id, params = item["custom_id"], item["params"]
        if not isinstance(custom_id, str) or not _CUSTOM_ID.fullmatch(custom_id):
            raise invalid_request(f"{where}.custom_id: must match ^[a-zA-Z0-9_-]{{1,64}}$.",
                                  param=f"{where}.custom_id")
        if custom_id in seen:
            raise invalid_request(f"{where}.custom_id: duplicate custom_id {custom_id!r}.",
                                  param=f"{where}.custom_id")
        seen.add(custom_id)
        if not isinstance(params, dict):
            raise invalid_request(f"{where}.params: must be an object.",
                                  param=f"{where}.params")
        try:
            check(ENDPOINT, params)
        except APIError as err:
            param = f"{where}.params" + (f".{err.param}" if err.param else "")
            raise invalid_request(f"{param}: {err.message}", param=param) from None
        raw = json.dumps(params, separators=(",", ":"))
        lines.append(NewLine(custom_id, raw, sort_key(params)))
        tokens += estimate_tokens(params, len(raw))
    return lines, tokens, model_of([item["params"] for item in items])


def add_message_batch_routes(app: web.Application) -> None:
    """Anthropic's Message Batches routes on `app`."""

    async def _batch(request: web.Request) -> tuple[Batches, KeyContext, BatchRecord]:
        return await found_batch(request, "anthropic", lambda batch_id: APIError(
            404, f"No message batch with id '{batch_id}'.", type="invalid_request_error",
            code="not_found"))

    async def create(request: web.Request) -> web.Response:
        batches, key = batches_of(request)
        lines, tokens, model = _requests(await json_body(request))
        record = await batches.create(key, dialect="anthropic", batch_id="msgbatch_" +
                                      secrets.token_hex(12), endpoint=ENDPOINT,
                                      lines=lines, tokens=tokens, model=model)
        return json_response(batch_object(request, record))

    async def retrieve(request: web.Request) -> web.Response:
        return json_response(batch_object(request, (await _batch(request))[2]))

    async def listing(request: web.Request) -> web.Response:
        batches, key = batches_of(request)
        limit = page_limit(request.query, 20, 1000)
        found = await batches.page(key, "anthropic", limit=limit + 1,
                                   after=request.query.get("after_id"),
                                   before=request.query.get("before_id"))
        return json_response(await page(
            found, limit, functools.partial(batch_object, request),
            from_end="before_id" in request.query))

    async def cancel(request: web.Request) -> web.Response:
        batches, key, record = await _batch(request)
        if record.status == "in_progress":
            await batches.cancel(key, record.id, "anthropic")
        fresh = await batches.get(key, record.id, "anthropic")
        return json_response(batch_object(request, fresh or record))

    async def delete(request: web.Request) -> web.Response:
        batches, key, record = await _batch(request)
        if not await batches.delete(key, record.id, "anthropic"):
            raise invalid_request(f"Message batch {record.id} is still being processed: "
                                  "cancel it, or wait for it to end, before deleting it.")
        return json_response({"id": record.id, "type": "message_batch_deleted"})

    async def results(request: web.Request) -> web.Response:
        batches, _, record = await _batch(request)
        if _status(record) != "ended":
            raise invalid_request(f"Message batch {record.id} has not ended yet: its "
                                  "results are available once processing_status is "
                                  "\"ended\".")
        unrun = "canceled" if record.status == "cancelled" else "expired"
        out = []
        for line in await batches.results(record.id):
            cut = "canceled" if line.state == "aborted" else unrun
            out.append(line.result if line.state == "done" and line.result is not None
                       else to_json({"custom_id": line.custom_id,
                                     "result": {"type": cut}}).decode())
        return web.Response(body="".join(f"{text}\n" for text in out).encode(),
                            content_type="application/x-jsonl")

    app.router.add_post("/v1/messages/batches", create)
    app.router.add_get("/v1/messages/batches", listing)
    app.router.add_get("/v1/messages/batches/{batch_id}", retrieve)
    app.router.add_post("/v1/messages/batches/{batch_id}/cancel", cancel)
    app.router.add_delete("/v1/messages/batches/{batch_id}", delete)
    app.router.add_get("/v1/messages/batches/{batch_id}/results", results)


class AnthropicShape:
    """A Message Batch's result lines (`MessageBatchIndividualResponse`); its results
    are read from the lines (`GET …/results`), not from files."""

    def succeeded(self, line: Claimed, request_id: str, body: dict[str, Any]) -> str:
        return self._line(line, {"type": "succeeded", "message": body})

    def errored(self, line: Claimed, request_id: str, err: APIError) -> tuple[int, str]:
        return err.status, self._line(line, {"type": "errored", "error": anthropic_error_body(
            err, request_id)})

    @staticmethod
    def _line(line: Claimed, result: dict[str, Any]) -> str:
        return to_json({"custom_id": line.custom_id, "result": result}).decode()

    def result_files(self, record: BatchRecord, results: Sequence[LineResult],
                     status: str) -> list[tuple[str, str, bytes]]:
        return []


__all__ = ["AnthropicShape", "add_message_batch_routes", "batch_object"]
