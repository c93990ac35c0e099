"""The one response writer of every generating route, whatever its dialect: bytes only.

A route parses and converts its request into the pipeline's `Call` (with its `build`
hook: the dialect's prompt work for the chosen deployment), and hands it with a
`Format` factory (the dialect's shape of this one response) to `answer`, which makes
two calls into the gateway:

1. `Pipeline.run`: every stage from routing and admission to input moderation, up to
   started generations (refusals surface before any byte);
2. `Run.complete` (the non-streamed body) or `Run.stream` (the events in order, with
   the points where a write may go out): the run orders the request's end itself —
   settle, the dialect's finish hook, capture, close — before the body or a stream's
   last bytes go out, so a response the client saw complete always has its ledger row,
   and its `cost` is that row's.

What is left here is the order of the bytes: events of one replica step go out in one
write, held back while the next step is already in; a failure after the 200 becomes the
dialect's error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from tokenyard.api.context import (
    ATTEMPTS,
    GENERATIONS,
    KEY,
    PIPELINE,
    REQUEST_ID,
    RESPONSE_ID,
    ROUTE,
    TICKET,
    TIMELINE,
)
from tokenyard.api.edge import EDGE
from tokenyard.api.middleware import open_stream, stream_failed
from tokenyard.api.sse import to_json
from tokenyard.errors import APIError, internal_error
from tokenyard.gateway.call import DONE, FLUSH, Build, Call, Failed, Finish, Render
from tokenyard.gateway.fallbacks import Fallback
from tokenyard.gateway.pipeline import Run

logger = logging.getLogger("tokenyard.api")


class Format(Render, Protocol):
    """One response in one dialect's shape (`gateway.call.Render`: its events are
    pydantic models), and how its events become SSE bytes."""

    #: Bytes after the last event (OpenAI's ``data: [DONE]``), or b"".
    terminator: bytes

    def encode(self, event: Any) -> bytes:
        """One event as SSE bytes."""
        ...

    def error(self, err: APIError) -> bytes:
        """The error event of a stream that failed after its 200."""
        ...


def json_response(obj: Any, status: int = 200) -> web.Response:
    """A JSON response of a pydantic model or of plain JSON data."""
    return web.Response(body=to_json(obj), status=status, content_type="application/json")


@dataclass
class Plan:
    """A generating route's request, parsed and converted: the model it names, its `build`
    hook, the rest of its `Call` (`options`: capability, text_size, param, bounded,
    first_user_text), and the `Format` its started run is rendered in. An HTTP route and
    a batch line (`api/batch/runner.py`) answer the same plan the same way."""

    model: str
    build: Build
    format: Callable[[Run], Format]
    stream: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    #: Run with the format at the request's end, once it is settled (`Run.end`).
    finish: Callable[[Any], Awaitable[None]] | None = None

    def finisher(self, fmt: Format) -> Finish | None:
        """`finish` bound to the run's format (None: nothing to run)."""
        finish = self.finish
        return None if finish is None else (lambda: finish(fmt))


async def answer(request: web.Request, plan: Plan) -> web.StreamResponse:
    """Run `plan` for this HTTP request and answer it."""
    run = await start(request, await new_call(request, plan.model, plan.build, **plan.options))
    fmt = plan.format(run)
    return await generate(request, run, fmt, stream=plan.stream, finish=plan.finisher(fmt))


async def new_call(
    request: web.Request, model: str, build: Build, *, capability: str = "chat",
    text_size: int = 0, param: str = "messages", bounded: bool = True,
    first_user_text: str | None = None, fallbacks: Sequence[Fallback] = (),
) -> Call:
    """The pipeline's `Call` for this HTTP request (its id, timeline, key and body)."""
    return Call(
        endpoint=request.path, request_id=request[REQUEST_ID], timeline=request[TIMELINE],
        model=model, build=build, key=request.get(KEY), capability=capability,
        text_size=text_size, param=param, bounded=bounded,
        first_user_text=first_user_text, raw=await request.read(), fallbacks=fallbacks,
    )


def note(request: web.Request, call: Call) -> None:
    """What the request's summary, trace and headers read of how far the call got."""
    if call.route is not None:
        request[ROUTE] = call.route
    if call.ticket is not None:
        request[TICKET] = call.ticket
    if call.gens:
        request[GENERATIONS] = call.gens
    if call.attempts:
        request[ATTEMPTS] = call.attempts


async def start(request: web.Request, call: Call) -> Run:
    """`Pipeline.run` for this request, noting how far it got whatever happens."""
    try:
        return await request.app[PIPELINE].run(call)
    finally:
        note(request, call)


async def count(request: web.Request, call: Call) -> int:
    """`Pipeline.count` for this request."""
    try:
        return await request.app[PIPELINE].count(call)
    finally:
        note(request, call)


async def generate(
    request: web.Request, run: Run, fmt: Format, *, stream: bool,
    finish: Finish | None = None,
) -> web.StreamResponse:
    """Answer a started `run` in `fmt`'s shape; the run ends itself (settled, `finish`
    run, captured, closed) before the body or the stream's last bytes go out, and is
    closed whatever happened (client gone, engine failure)."""
    response_id = (getattr(getattr(fmt, "stream", None), "id", None)  # chatcmpl-…, msg_…
                   or getattr(getattr(fmt, "response", None), "id", None))  # resp_…
    if isinstance(response_id, str):
        request.setdefault(RESPONSE_ID, response_id)
    if not stream:
        return json_response(await run.complete(fmt, finish))
    return await _stream(request, fmt, run, finish)


async def _stream(request: web.Request, fmt: Format, run: Run,
                  finish: Finish | None = None) -> web.StreamResponse:
    """The run's stream as SSE: its headers go out at its first FLUSH, before any output
    is read (their Server-Timing holds the stages before the first byte)."""
    response: web.StreamResponse | None = None
    pending: list[bytes] = []
    async with contextlib.aclosing(run.stream(fmt, finish)) as events:
        async for event in events:
            if isinstance(event, Failed):
                err = _stream_failure(request, event.error)
                pending.append(fmt.error(err))
                response = response or await open_stream(request)
                stream_failed(request, response, err)
            elif event is DONE:
                pending.append(fmt.terminator)
            elif event is FLUSH:
                response = response or await open_stream(request)
                await _send(request, response, pending)
            else:
                pending.append(fmt.encode(event))
    assert response is not None  # the stream begins with a FLUSH
    return response


async def _send(request: web.Request, response: web.StreamResponse,
                pending: list[bytes]) -> None:
    """Write the events in `pending` in one write (one syscall, one HTTP chunk) and
    empty it; nothing when it is empty. A client that does not take the write within the
    edge's stream write timeout has stopped reading: its connection is closed and the
    request ends as a disconnect (ConnectionResetError)."""
    if pending:
        data = b"".join(pending)
        pending.clear()
        try:
            # A timeout scope, not wait_for: that would start a task for every write.
            async with asyncio.timeout(request.app[EDGE].limits.stream_write_timeout_s):
                await response.write(data)
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("the client stopped reading its stream") from None


def _stream_failure(request: web.Request, exc: Exception) -> APIError:
    """The error event for a failure after a stream began (logged unless the API's own)."""
    if isinstance(exc, APIError):
        return exc
    logger.exception("stream of %s failed", request.get(REQUEST_ID), exc_info=exc)
    return internal_error()
