"""What wraps every route: the request id, the timeline and its Server-Timing header, the
gateway's authentication, Idempotency-Key, and every failure rendered in the route's own
dialect (OpenAI's or Anthropic's error body and rate-limit headers)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

from aiohttp import web

from tokenyard.api.context import (
    ERROR_CODE,
    KEY,
    REQUEST_ID,
    STATE,
    STREAM_ERROR_STATUS,
    TICKET,
    TIMELINE,
    TRACE,
)
from tokenyard.api.edge import EDGE
from tokenyard.api.errors import (
    anthropic_status,
    openai_status,
    render_anthropic,
    render_openai,
)
from tokenyard.api.ratelimit_headers import ratelimit_headers
from tokenyard.api.refusals import count_refusal
from tokenyard.api.request_end import request_ended
from tokenyard.api.sse import SSE_HEADERS
from tokenyard.api.web import is_public
from tokenyard.errors import APIError, body_too_large, internal_error, not_found
from tokenyard.gateway import idempotency
from tokenyard.gateway.gate import Gateway, RateLimitExceeded
from tokenyard.telemetry import tracing
from tokenyard.telemetry.timeline import Timeline
from tokenyard.telemetry.tracing import TRACEPARENT

logger = logging.getLogger("tokenyard.api")

REQUEST_ID_HEADER = "x-request-id"
ANTHROPIC_REQUEST_ID_HEADER = "request-id"
#: A client's x-request-id is kept (as the prefix of the request's id) only when it is
#: short, printable and safe in a log line, a URL path and a trace attribute.
_CLIENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,39}")
#: Routes anyone may call (probes, scrapes, the schema, and the browser pages:
#: `api/web.py`); everything else needs a key.
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json"})
#: Routes that take an Idempotency-Key.
IDEMPOTENT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages",
                              "/v1/responses"})

_RECORDING: web.RequestKey[bool] = web.RequestKey("recording", bool)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_anthropic(request: web.Request) -> bool:
    """Whether the route speaks the Anthropic dialect (else OpenAI's); /v1/models speaks
    both, Anthropic's to a request with its SDK's headers (`api/models`)."""
    return request.path.startswith("/v1/messages") or (
        request.path.startswith("/v1/models")
        and ("anthropic-version" in request.headers or "x-api-key" in request.headers))


def _error_response(request: web.Request, err: APIError) -> web.Response:
    request[ERROR_CODE] = err.code or err.type
    rendered = (
        render_anthropic(err, request.get(REQUEST_ID))
        if is_anthropic(request) else render_openai(err)
    )
    headers = dict(rendered.headers)
    headers.pop("content-type", None)
    if isinstance(err, RateLimitExceeded):
        headers.update(ratelimit_headers(err.state, is_anthropic(request)))
    return web.Response(
        status=rendered.status, body=rendered.body, headers=headers,
        content_type="application/json",
    )


@web.middleware
async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """x-request-id and Server-Timing on every response, every failure in the route's
    own error shape, and the request's summary once it ended."""
    request[TIMELINE] = Timeline()
    started_at = time.time()
    request[REQUEST_ID] = new_request_id(request.headers.get(REQUEST_ID_HEADER))
    response: web.StreamResponse | None = None
    outgoing = None
    if tracing.enabled() and (ids := tracing.begin(request.headers.get(TRACEPARENT))):
        request[TRACE] = ids
        outgoing = tracing.OUTGOING.set(ids.traceparent())  # what calls to replicas carry
    try:
        response = await _respond(request, handler)
        return response
    finally:
        if outgoing is not None:
            tracing.OUTGOING.reset(outgoing)
        # Soon, not now: a non-streamed body is written after this returns, and the
        # summary, its log line and its spans should cost the response no latency.
        asyncio.get_running_loop().call_soon(request_ended, request, response, started_at)


def new_request_id(client_id: str | None) -> str:
    """The request's one id: in the response's x-request-id, the ledger row, the log line,
    the trace and (``<id>-<i>`` per prompt) the replica's request.

    It is always unique and chosen here: the ledger keeps one row per id, so an id a
    client could repeat would let its second request go unbilled, or collide with
    another tenant's. A usable client id is kept as a prefix (``<client id>.<16 hex>``),
    so the client still finds its own id in logs and traces; anything else is ignored.
    """
    suffix = uuid.uuid4().hex
    if client_id and _CLIENT_ID.fullmatch(client_id):
        return f"{client_id}.{suffix[:16]}"
    return f"req_{suffix}"


async def _respond(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The handler's response, or the error it raised in the route's error shape."""
    request_id = request[REQUEST_ID]
    stage: str | None = "edge"  # the stage running here, for the refusals counter
    try:
        request.app[EDGE].admit(request)
        stage = None
        gateway = request.app[STATE].gateway
        if gateway is None or request.path in PUBLIC_PATHS or is_public(request.path):
            response = await handler(request)
        else:
            stage = "auth"
            request[KEY] = await gateway.authenticate(request.headers, request[TIMELINE],
                                                         request.remote)
            stage = None
            idem_key = request.headers.get(idempotency.HEADER)
            if idem_key is not None and request.method == "POST" and (
                request.path in IDEMPOTENT_PATHS
            ):
                response = await _idempotent(request, gateway, idem_key, handler)
            else:
                response = await handler(request)
    except APIError as err:
        response = _error_response(request, err)
        count_refusal(request, err, stage)
    except web.HTTPRequestEntityTooLarge:
        too_large = body_too_large(request.app[STATE].max_body_bytes)
        response = _error_response(request, too_large)
        count_refusal(request, too_large, "edge")
    except web.HTTPException as exc:
        http_err = (
            not_found(f"Unknown route {request.method} {request.path}.")
            if exc.status == 404 else APIError(exc.status, exc.reason or "error")
        )
        response = _error_response(request, http_err)
        count_refusal(request, http_err)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        # Never a traceback for the client: log it here, answer in the API's shape.
        logger.exception("unhandled error in %s %s (%s)", request.method, request.path,
                         request_id)
        response = _error_response(request, internal_error())
    if not response.prepared:
        _add_headers(request, response)
    return response


def _add_headers(request: web.Request, response: web.StreamResponse) -> None:
    """x-request-id, Server-Timing and (admitted requests) the rate-limit headers."""
    response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID]
    # Anthropic's name for it: its SDK reads this one into `_request_id`.
    response.headers[ANTHROPIC_REQUEST_ID_HEADER] = request[REQUEST_ID]
    server_timing = request[TIMELINE].server_timing()
    if server_timing:
        response.headers["Server-Timing"] = server_timing
    ticket = request.get(TICKET)
    if ticket is not None:
        response.headers.update(
            ratelimit_headers(ticket.admission.state, is_anthropic(request))
        )


class RecordingStreamResponse(web.StreamResponse):
    """A stream that keeps a copy of what it sent, for Idempotency-Key replays; a stream
    that ended in an error event says so in `failed`, and is not kept."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.recorded = bytearray()
        self.failed = False

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        self.recorded += data
        await super().write(data)


async def open_stream(request: web.Request) -> web.StreamResponse:
    """An SSE response with its headers sent (recorded when the request is idempotent)."""
    cls = RecordingStreamResponse if request.get(_RECORDING) else web.StreamResponse
    response = cls(headers=SSE_HEADERS)
    # A stream's Server-Timing holds the stages before its first byte; the last event has all.
    _add_headers(request, response)
    await response.prepare(request)
    return response


def stream_failed(request: web.Request, response: web.StreamResponse, err: APIError) -> None:
    """Mark a stream that ended in an error event `err`, after its 200 went out: its
    record keeps the error's status (as the dialect renders it), not the 200."""
    request[ERROR_CODE] = err.code or err.type
    request[STREAM_ERROR_STATUS] = (anthropic_status(err) if is_anthropic(request)
                                    else openai_status(err))
    if isinstance(response, RecordingStreamResponse):
        response.failed = True


async def _idempotent(
    request: web.Request, gateway: Gateway, idem_key: str, handler: Handler
) -> web.StreamResponse:
    """Run `handler` once per (API key, Idempotency-Key); replay its stored 2xx response
    to the same key on the same route only (gateway/idempotency.py)."""
    caller = request[KEY]
    store = gateway.store
    stored = await idempotency.claim(store, caller,
                                     idempotency.route_of(request.method, request.path),
                                     idem_key, await request.read())
    if stored is not None:
        headers = {**stored.headers, idempotency.REPLAYED_HEADER: "true"}
        return web.Response(status=stored.status_code or 200, body=stored.body or b"",
                            headers=headers)
    request[_RECORDING] = True
    try:
        response = await handler(request)
    except BaseException:
        # A task of its own: a cancelled handler (client gone) must still free the key.
        asyncio.get_running_loop().create_task(idempotency.release(store, caller, idem_key))
        raise
    if isinstance(response, RecordingStreamResponse):
        failed, body = response.failed, bytes(response.recorded)
    else:
        failed, body = False, bytes(cast(bytes, getattr(response, "body", b"")) or b"")
    content_type = response.headers.get("Content-Type", "application/json")
    await idempotency.finish(store, caller, idem_key, response.status,
                             {"Content-Type": content_type}, body, failed=failed)
    return response
