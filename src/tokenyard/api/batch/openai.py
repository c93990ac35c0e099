"""OpenAI's Batch API: batches of an uploaded file's lines, in OpenAI's shapes.

    POST   /v1/batches                    {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches                    ?after &limit (newest first)
    GET    /v1/batches/{batch_id}
    POST   /v1/batches/{batch_id}/cancel

Every batch is its org's: another org's is "not found". A batch object is read from its
one row (its counts and usage are kept there as its lines end). A cancel cuts the lines
in flight: each ends `cancelled` in the error file (`batch_cancelled`), billed for what
it computed, as do the lines never run.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from tokenyard.api.batch.files import ENDPOINTS, parse_lines
from tokenyard.api.batch.http import batches_of, epoch, found_batch, json_body, page
from tokenyard.api.batch.lines import estimate_tokens, model_of, sort_key
from tokenyard.api.errors import openai_error_body, openai_status
from tokenyard.api.respond import json_response
from tokenyard.api.schemas import page_limit
from tokenyard.api.sse import to_json
from tokenyard.errors import APIError, invalid_request
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.batches import Batches, BatchRecord, Claimed, LineResult, NewLine

#: A batch's end status → its time field.
ENDED_AT = {"completed": "completed_at", "expired": "expired_at",
            "cancelled": "cancelled_at", "failed": "failed_at"}


def batch_object(record: BatchRecord) -> dict[str, Any]:
    """The Batch object of `record` (OpenAI's fields; `model` and `usage` as the
    openai SDK's `Batch` has them)."""
    ended = ENDED_AT.get(record.status)
    unrun = record.unended if ended else 0
    body: dict[str, Any] = {
        "id": record.id, "object": "batch", "endpoint": record.endpoint,
        "model": record.model,
        "input_file_id": record.input_file_id, "completion_window": "24h",
        "status": record.status, "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id, "created_at": epoch(record.created_at),
        "in_progress_at": epoch(record.in_progress_at),
        "expires_at": epoch(record.expires_at),
        "cancelling_at": epoch(record.cancelling_at),
        "finalizing_at": epoch(record.ended_at) if ended else None,
        "request_counts": {"total": record.total, "completed": record.succeeded,
                           "failed": record.failed + record.cancelled + unrun},
        "usage": {"input_tokens": record.input_tokens,
                  "input_tokens_details": {"cached_tokens": record.cached_tokens},
                  "output_tokens": record.output_tokens,
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": record.input_tokens + record.output_tokens},
        "metadata": record.metadata,
    }
    if ended:
        body[ended] = epoch(record.ended_at)
    return {name: value for name, value in body.items()
            if value is not None or name == "metadata"}


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in value.items())):
        raise invalid_request("'metadata' must be an object of at most 16 string values "
                              "(keys up to 64 characters, values up to 512).",
                              param="metadata")
    return value


async def create_batch(request: web.Request) -> web.Response:
    """POST /v1/batches."""
    batches, key = batches_of(request)
    body = await json_body(request)
    if not isinstance(body, dict):
        raise invalid_request("The body must be a JSON object.")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise invalid_request(f"'endpoint' must be one of {', '.join(ENDPOINTS)}.",
                              param="endpoint")
    if body.get("completion_window") != "24h":
        raise invalid_request("'completion_window' must be \"24h\".",
                              param="completion_window")
    unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata",
                           "output_expires_after"}
    if unknown:
        raise invalid_request(f"Unrecognized request argument: {sorted(unknown)[0]}.",
                              param=sorted(unknown)[0], code="unknown_parameter")
    metadata = _metadata(body.get("metadata"))
    file_id = body.get("input_file_id")
    record = await batches.file(key, file_id) if isinstance(file_id, str) else None
    content = await batches.file_content(key, record.id) if record is not None else None
    if record is None or content is None:
        raise invalid_request(f"No such File object: {file_id}", param="input_file_id")
    if record.purpose != "batch":
        raise invalid_request(f"File {file_id} was not uploaded for purpose \"batch\".",
                              param="input_file_id")
    items = await asyncio.to_thread(parse_lines, content)
    lines, tokens = [], 0
    for number, item in enumerate(items, start=1):
        if item["url"] != endpoint:
            raise invalid_request(
                f"Line {number} of {file_id} is for {item['url']}, but the batch's "
                f"endpoint is {endpoint}: every line must use the batch's endpoint.",
                param="input_file_id")
        raw = json.dumps(item["body"], separators=(",", ":"))
        lines.append(NewLine(item["custom_id"], raw, sort_key(item["body"])))
        tokens += estimate_tokens(item["body"], len(raw))
    created = await batches.create(
        key, dialect="openai", batch_id="batch_" + secrets.token_hex(12), endpoint=endpoint,
        lines=lines, tokens=tokens, model=model_of([item["body"] for item in items]),
        input_file_id=file_id, metadata=metadata)
    return json_response(batch_object(created))


async def _batch(request: web.Request) -> tuple[Batches, KeyContext, BatchRecord]:
    return await found_batch(request, "openai", lambda batch_id: APIError(
        404, f"No batch found with id '{batch_id}'.", param="batch_id",
        type="invalid_request_error", code="not_found"))


async def get_batch(request: web.Request) -> web.Response:
    return json_response(batch_object((await _batch(request))[2]))


async def list_batches(request: web.Request) -> web.Response:
    batches, key = batches_of(request)
    limit = page_limit(request.query, 20, 100)
    found = await batches.page(key, "openai", limit=limit + 1,
                               after=request.query.get("after"))
    return json_response(await page(found, limit, batch_object, object="list"))


async def cancel_batch(request: web.Request) -> web.Response:
    batches, key, record = await _batch(request)
    if record.status == "in_progress":
        await batches.cancel(key, record.id, "openai")
    elif record.status not in ("cancelling", "cancelled"):
        raise APIError(409, f"Cannot cancel a batch with status '{record.status}'.",
                       type="invalid_request_error", code="batch_not_cancellable")
    fresh = await batches.get(key, record.id, "openai")
    return json_response(batch_object(fresh or record))


def add_batch_routes(app: web.Application) -> None:
    """OpenAI's batch routes on `app`."""
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)


# ------------------------------------------------------------------- its result lines

#: Why a line has no response, by how it ended: (error code, message).
_NOT_RUN = {
    "expired": ("batch_expired", "This request could not be executed before the "
                "completion window expired."),
    "cancelled": ("batch_cancelled", "This request was cancelled with its batch before "
                  "it completed."),
}


def _output_id(request_id: str) -> str:
    return "batch_req_" + hashlib.sha256(request_id.encode()).hexdigest()[:24]


class OpenAIShape:
    """An OpenAI batch's output lines (`BatchRequestOutput`) and result files."""

    def succeeded(self, line: Claimed, request_id: str, body: dict[str, Any]) -> str:
        return self._line(line, request_id, 200, body)

    def errored(self, line: Claimed, request_id: str, err: APIError) -> tuple[int, str]:
        status = openai_status(err)
        return status, self._line(line, request_id, status, openai_error_body(err))

    @staticmethod
    def _line(line: Claimed, request_id: str, status: int, body: Any) -> str:
        return to_json({"id": _output_id(request_id), "custom_id": line.custom_id,
                        "response": {"status_code": status, "request_id": request_id,
                                     "body": body},
                        "error": None}).decode()

    def result_files(self, record: BatchRecord, results: Sequence[LineResult],
                     status: str) -> list[tuple[str, str, bytes]]:
        """The output file (lines answered 200) and the error file (the rest: refused,
        cut by a cancel, never run)."""
        ok: list[str] = []
        failed: list[str] = []
        for line in results:
            if line.state == "done" and line.result is not None:
                (ok if line.status_code == 200 else failed).append(line.result)
                continue
            why = _NOT_RUN.get("cancelled" if line.state == "aborted" else status)
            if why is not None:
                failed.append(to_json({
                    "id": _output_id(f"{record.id}-{line.line}"),
                    "custom_id": line.custom_id, "response": None,
                    "error": {"code": why[0], "message": why[1]}}).decode())
        files = []
        for column, name, found in (("output_file_id", "output", ok),
                                    ("error_file_id", "error", failed)):
            if found:
                files.append((column, f"{record.id}_{name}.jsonl",
                              "".join(f"{text}\n" for text in found).encode()))
        return files


__all__ = ["OpenAIShape", "add_batch_routes", "batch_object"]
