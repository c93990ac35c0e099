"""OpenAI's Files API, for the Batch API: a batch's input file and its result files.

    POST   /v1/files                      multipart: file (JSONL), purpose "batch"
    GET    /v1/files                      ?purpose &limit &order &after
    GET    /v1/files/{file_id}            the file object
    GET    /v1/files/{file_id}/content    its bytes
    DELETE /v1/files/{file_id}

Every file is its org's: another org's is "not found". An uploaded batch file is checked
line by line as the batch will run it (`lines.check`: the route's own parse), and the
first bad line is named in a 400.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import BodyPartReader, web

from tokenyard.api.batch.http import batches_of, epoch, page
from tokenyard.api.batch.lines import check
from tokenyard.api.respond import json_response
from tokenyard.api.schemas import page_limit
from tokenyard.errors import APIError, invalid_request
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.batches import Batches, FileRecord

#: What an uploaded batch file may hold.
MAX_FILE_BYTES = 100 * 2**20
MAX_LINES = 50_000
#: The routes an OpenAI batch may run.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


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


def add_file_routes(app: web.Application) -> None:
    """The Files API's routes on `app`."""
    app.router.add_post("/v1/files", upload)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
