"""OpenAI's Batch API: files and batches, in OpenAI's shapes.

    POST   /v1/files                      multipart: file (JSONL), purpose "batch"
    GET    /v1/files                      ?purpose &limit &order &after
    GET    /v1/files/{file_id}            the file object
    GET    /v1/files/{file_id}/content    its bytes
    DELETE /v1/files/{file_id}
    POST   /v1/batches                    {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches                    ?after &limit (newest first)
    GET    /v1/batches/{batch_id}
    POST   /v1/batches/{batch_id}/cancel

Every file and batch is its org's: another org's is "not found". An uploaded batch file
is checked line by line as the batch will run it (`batch_lines.check`: the route's own
parse), and the first bad line is named in a 400. `install` adds these routes and
Anthropic's, and starts this process's batch worker (`gateway/batches.BatchLane`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import secrets
from collections.abc import Sequence
from typing import Any

from aiohttp import BodyPartReader, web

from tokenyard.api.batch_http import BATCHES, batches_of, found_batch, json_body, page
from tokenyard.api.batch_lines import ROUTES, check, estimate_tokens, guarded, run_line, sort_key
from tokenyard.api.context import PIPELINE, STATE, AppState
from tokenyard.api.errors import openai_error_body, openai_status
from tokenyard.api.message_batches import add_message_batch_routes, anthropic_dialect
from tokenyard.api.respond import json_response
from tokenyard.api.schemas import page_limit
from tokenyard.api.sse import to_json
from tokenyard.config import ServeConfig
from tokenyard.deployments import PriceSpec
from tokenyard.errors import APIError, invalid_request
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.batches import (
    Batches,
    BatchLane,
    BatchRecord,
    BatchSettings,
    Busy,
    Claimed,
    Dialect,
    FileRecord,
    LineResult,
    NewLine,
    busy_wait,
    line_request_id,
)

#: What an uploaded batch file may hold.
MAX_FILE_BYTES = 100 * 2**20
MAX_LINES = 50_000
#: The routes an OpenAI batch may run.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")

LANE: web.AppKey[BatchLane] = web.AppKey("tokenyard_batch_lane", BatchLane)


def epoch(value: Any) -> int | None:
    return None if value is None else int(value.timestamp())


# ---------------------------------------------------------------------------- files


def file_object(record: FileRecord) -> dict[str, Any]:
    return {"id": record.id, "object": "file", "bytes": record.bytes,
            "created_at": epoch(record.created_at), "filename": record.filename,
            "purpose": record.purpose, "status": "processed"}


def parse_lines(content: bytes) -> list[dict[str, Any]]:
    """The JSONL batch file's requests, each checked as its route would parse it; a 400
    naming the first bad line (1-based) otherwise."""
    text = content.decode("utf-8", errors="strict")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(out) >= MAX_LINES:
            raise _bad_line(number, f"a batch file may hold at most {MAX_LINES} requests")
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _bad_line(number, f"not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise _bad_line(number, "not a JSON object")
        custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            raise _bad_line(number, "'custom_id' must be a non-empty string")
        if custom_id in seen:
            raise _bad_line(number, f"duplicate custom_id {custom_id!r}")
        seen.add(custom_id)
        if item.get("method", "POST") != "POST":
            raise _bad_line(number, "'method' must be \"POST\"")
        if url not in ENDPOINTS:
            raise _bad_line(number, f"'url' must be one of {', '.join(ENDPOINTS)}, "
                                    f"not {url!r}")
        if not isinstance(body, dict):
            raise _bad_line(number, "'body' must be a JSON object")
        try:
            check(url, body)
        except APIError as err:
            where = f" ('body.{err.param}')" if err.param else ""
            raise _bad_line(number, f"the request body would be refused{where}: "
                                    f"{err.message}") from None
        out.append(item)
    if not out:
        raise invalid_request("The batch file holds no request.", param="file")
    return out


def _bad_line(number: int, why: str) -> APIError:
    return invalid_request(f"Line {number} of the batch file: {why}.", param="file",
                           code="invalid_batch_file")


async def upload(request: web.Request) -> web.Response:
    """POST /v1/files (multipart/form-data: `file`, `purpose`)."""
    batches, key = batches_of(request)
    if not request.content_type.startswith("multipart/"):
        raise invalid_request("Upload the file as multipart/form-data.", param="file")
    reader = await request.multipart()
    purpose, filename, content = None, "upload.jsonl", None
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            continue
        if part.name == "purpose":
            purpose = (await part.text()).strip()
        elif part.name == "file":
            filename = part.filename or filename
            chunks, size = [], 0
            while chunk := await part.read_chunk(2**16):
                size += len(chunk)
                if size > MAX_FILE_BYTES:
                    raise APIError(413, f"The file is larger than {MAX_FILE_BYTES} bytes.",
                                   param="file", type="invalid_request_error")
                chunks.append(chunk)
            content = b"".join(chunks)
    if content is None:
        raise invalid_request("Missing the 'file' field.", param="file")
    if purpose != "batch":
        raise invalid_request(f"Invalid 'purpose' {purpose!r}: this server stores files "
                              "for the Batch API only (\"batch\").", param="purpose")
    try:
        lines = await asyncio.to_thread(parse_lines, content)
    except UnicodeDecodeError:
        raise invalid_request("The batch file is not UTF-8 text.", param="file") from None
    record = await batches.add_file(key, filename[:255], purpose, content, len(lines))
    return json_response(file_object(record))


async def list_files(request: web.Request) -> web.Response:
    batches, key = batches_of(request)
    query = request.query
    limit = page_limit(query, 10_000, 10_000)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_request("'order' must be 'asc' or 'desc'.", param="order")
    found = await batches.files(key, purpose=query.get("purpose"), limit=limit + 1,
                                after=query.get("after"), newest_first=order == "desc")
    return json_response(await page(found, limit, file_object, object="list"))


async def _file(request: web.Request) -> tuple[Batches, KeyContext, FileRecord]:
    batches, key = batches_of(request)
    file_id = request.match_info["file_id"]
    record = await batches.file(key, file_id)
    if record is None:
        raise _no_file(file_id)
    return batches, key, record


def _no_file(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="id",
                    type="invalid_request_error", code="not_found")


async def get_file(request: web.Request) -> web.Response:
    return json_response(file_object((await _file(request))[2]))


async def file_content(request: web.Request) -> web.Response:
    batches, key, record = await _file(request)
    content = await batches.file_content(key, record.id)
    if content is None:
        raise _no_file(record.id)
    return web.Response(body=content, content_type="application/octet-stream")


async def delete_file(request: web.Request) -> web.Response:
    batches, key = batches_of(request)
    file_id = request.match_info["file_id"]
    if not await batches.delete_file(key, file_id):
        raise _no_file(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})


# ---------------------------------------------------------------------------- batches


async def batch_object(batches: Batches, record: BatchRecord) -> dict[str, Any]:
    counts = await batches.counts(record.id)
    ended = {"completed": "completed_at", "expired": "expired_at",
             "cancelled": "cancelled_at", "failed": "failed_at"}.get(record.status)
    unrun = counts["queued"] + counts["running"] if ended else 0
    body: dict[str, Any] = {
        "id": record.id, "object": "batch", "endpoint": record.endpoint,
        "input_file_id": record.input_file_id, "completion_window": "24h",
        "status": record.status, "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id, "created_at": epoch(record.created_at),
        "in_progress_at": epoch(record.in_progress_at),
        "expires_at": epoch(record.expires_at),
        "cancelling_at": epoch(record.cancelling_at),
        "finalizing_at": epoch(record.ended_at) if ended else None,
        "request_counts": {"total": record.total, "completed": counts["succeeded"],
                           "failed": counts["failed"] + unrun},
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
    created = await batches.create(key, dialect="openai", batch_id="batch_" +
                                   secrets.token_hex(12), endpoint=endpoint, lines=lines,
                                   tokens=tokens, input_file_id=file_id, metadata=metadata)
    return json_response(await batch_object(batches, created))


async def _batch(request: web.Request) -> tuple[Batches, KeyContext, BatchRecord]:
    return await found_batch(request, "openai", lambda batch_id: APIError(
        404, f"No batch found with id '{batch_id}'.", param="batch_id",
        type="invalid_request_error", code="not_found"))


async def get_batch(request: web.Request) -> web.Response:
    batches, _, record = await _batch(request)
    return json_response(await batch_object(batches, record))


async def list_batches(request: web.Request) -> web.Response:
    batches, key = batches_of(request)
    limit = page_limit(request.query, 20, 100)
    found = await batches.page(key, "openai", limit=limit + 1,
                               after=request.query.get("after"))
    return json_response(await page(found, limit, functools.partial(batch_object, batches),
                                    object="list"))


async def cancel_batch(request: web.Request) -> web.Response:
    batches, key, record = await _batch(request)
    if record.status == "in_progress":
        await batches.cancel(key, record.id, "openai")
    elif record.status not in ("cancelling", "cancelled"):
        raise APIError(409, f"Cannot cancel a batch with status '{record.status}'.",
                       type="invalid_request_error", code="batch_not_cancellable")
    fresh = await batches.get(key, record.id, "openai")
    return json_response(await batch_object(batches, fresh or record))


# ---------------------------------------------------------------------------- the lane


def openai_dialect(app: web.Application) -> Dialect:
    """How an OpenAI batch's lines run and what its result files hold."""

    async def run(line: Claimed, key: KeyContext | None) -> tuple[int, str]:
        status, body, err = await guarded(run_line(app[PIPELINE], app[STATE], line, key,
                                                   line.endpoint), line)
        if err is not None:
            wait = busy_wait(err)
            if wait is not None:
                raise Busy(wait)
            status, body = openai_status(err), openai_error_body(err)
        request_id = line_request_id(line.batch_id, line.line)
        return status, to_json({
            "id": "batch_req_" + hashlib.sha256(request_id.encode()).hexdigest()[:24],
            "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}).decode()

    def result_files(record: BatchRecord, results: Sequence[LineResult],
                     status: str) -> list[tuple[str, str, bytes]]:
        why = {"expired": ("batch_expired", "This request could not be executed before "
                           "the completion window expired."),
               "cancelled": ("batch_cancelled", "This request was not executed: the "
                             "batch was cancelled.")}.get(status)
        ok: list[str] = []
        failed: list[str] = []
        for line in results:
            if line.state == "done" and line.result is not None:
                (ok if line.status_code == 200 else failed).append(line.result)
            elif why is not None:
                failed.append(to_json({"id": f"batch_req_{record.id}_{line.line}",
                                       "custom_id": line.custom_id, "response": None,
                                       "error": {"code": why[0], "message": why[1]}}
                                      ).decode())
        files = []
        for column, name, found in (("output_file_id", "output", ok),
                                    ("error_file_id", "error", failed)):
            if found:
                files.append((column, f"{record.id}_{name}.jsonl",
                              "".join(f"{text}\n" for text in found).encode()))
        return files

    return Dialect(run, result_files)


def install(app: web.Application) -> None:
    """The Batch API's routes on `app`, and, behind a gateway, this process's batch
    worker (started and stopped with the application)."""
    app.router.add_post("/v1/files", upload)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
    add_message_batch_routes(app)

    async def start(app: web.Application) -> None:
        gateway = app[STATE].gateway
        if gateway is None:
            return
        batches = app[BATCHES] = Batches(gateway.store, settings())
        gateway.billing.fixed_batch_prices = functools.partial(fleet_batch_prices,
                                                               app[STATE])
        lane = app[LANE] = BatchLane(batches, {"openai": openai_dialect(app),
                                               "anthropic": anthropic_dialect(app, busy_wait)},
                                     lambda: gateway.live_open)
        lane.start()

    async def stop(app: web.Application) -> None:
        lane = app.get(LANE)
        if lane is not None:
            await lane.close()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)


def fleet_batch_prices(state: AppState, model: str) -> PriceSpec | None:
    """The batch prices the fleet file sets for deployment `model` (None: none set, so
    half its live prices). Read from the served fleet, so a reload applies at once."""
    served = state.deployments.get(model)
    return served.spec.batch_prices if served is not None else None


def settings() -> BatchSettings:
    """The lane's settings: the `batch_*` fields of the serving process's `ServeConfig`
    (TOKENYARD_BATCH_CONCURRENCY, TOKENYARD_BATCH_LEASE_S,
    TOKENYARD_BATCH_ENQUEUED_TOKENS: the default of an org without its own quota)."""
    return BatchSettings.of(ServeConfig.from_env())


__all__ = ["ROUTES", "install"]
