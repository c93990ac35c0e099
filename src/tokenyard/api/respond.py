"""The one response writer of every generating route, whatever its dialect.

A route parses and converts its request into the pipeline's `Call` (with its `build`
hook: the dialect's prompt work for the chosen deployment), and hands it with a
`Format` factory (the dialect's shape of this one response) to `generate`, which:

1. runs the gateway's pipeline up to started generations (`Pipeline.run`: every stage
   from routing and admission to input moderation; refusals surface before any byte),
2. answers with the non-streamed body, or streams the format's events as SSE: events of
   one replica step go out in one write, held back while the next step is already in;
   the last event (or the body) carries the request's `timings` and, behind the gateway,
   its `cost`; a failure after the 200 becomes the dialect's error event,
3. settles the run with what the generations really used — before the body or a
   stream's last bytes go out, so a response the client saw complete always has its
   ledger row, and its `cost` is that row's.

No stage logic lives here: only the order of the bytes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from pydantic import BaseModel

from tokenyard.api.context import (
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
from tokenyard.gateway.gate import Ticket
from tokenyard.gateway.pipeline import Build, Call, Generated, Run
from tokenyard.telemetry.timeline import Timeline
from tokenyard.wire.outputs import Completion, RequestOutput

logger = logging.getLogger("tokenyard.api")


class Format(Protocol):
    """One response in one dialect's shape. Events are pydantic models (or their JSON
    with `timings` added) until `encode` makes them SSE bytes."""

    #: Bytes after the last event (OpenAI's ``data: [DONE]``), or b"".
    terminator: bytes

    def body(
        self, gens: Sequence[Generated], completions: Sequence[list[Completion]]
    ) -> BaseModel:
        """The non-streamed body; `completions[i]` are prompt i's finished choices."""
        ...

    def head(self) -> list[BaseModel]:
        """Events that go out with the first step's output, before its own."""
        ...

    def events(self, index: int, out: RequestOutput) -> list[BaseModel]:
        """The events of one step's output of prompt `index`."""
        ...

    def tail(self, gens: Sequence[Generated]) -> list[BaseModel]:
        """Events after every generation finished (a usage event)."""
        ...

    def encode(self, event: Any) -> bytes:
        """One event as SSE bytes."""
        ...

    def error(self, err: APIError) -> bytes:
        """The error event of a stream that failed after its 200."""
        ...


def json_response(obj: Any, status: int = 200) -> web.Response:
    """A JSON response of a pydantic model or of plain JSON data."""
    return web.Response(body=to_json(obj), status=status, content_type="application/json")


def with_timings(event: BaseModel, request: web.Request) -> dict[str, Any]:
    """`stamped` with this request's timeline and ticket."""
    return stamped(event, request[TIMELINE], request.get(TICKET))


def stamped(event: BaseModel, timeline: Timeline, ticket: Ticket | None) -> dict[str, Any]:
    """A response's last event (or its whole body) with the request's stage durations (ms)
    as `timings` — the Server-Timing figures the header could not hold, since a stream's
    went out before decoding — and, behind the gateway, its `cost`: the ledger row's
    charge with its line items, as decimal strings. (llama.cpp's server puts a `timings`
    object in its last chunk too; SDKs ignore both.)"""
    body = event.model_dump(mode="json")
    body["timings"] = timeline.timings_ms()
    if ticket is not None and ticket.cost is not None:
        body["cost"] = ticket.cost.to_json()
    return body


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
    #: Run with the format once the response is settled (see `generate`'s `finish`).
    finish: Callable[[Any], Awaitable[None]] | None = None

    def finisher(self, fmt: Format) -> Callable[[], Awaitable[None]] | None:
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
    first_user_text: str | None = None,
) -> Call:
    """The pipeline's `Call` for this HTTP request (its id, timeline, key and body)."""
    return Call(
        endpoint=request.path, request_id=request[REQUEST_ID], timeline=request[TIMELINE],
        model=model, build=build, key=request.get(KEY), capability=capability,
        text_size=text_size, param=param, bounded=bounded,
        first_user_text=first_user_text, raw=await request.read(),
    )


def note(request: web.Request, call: Call) -> None:
    """What the request's summary, trace and headers read of how far the call got."""
    if call.route is not None:
        request[ROUTE] = call.route
    if call.ticket is not None:
        request[TICKET] = call.ticket
    if call.gens:
        request[GENERATIONS] = call.gens


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
    finish: Callable[[], Awaitable[None]] | None = None,
) -> web.StreamResponse:
    """Answer a started `run` in `fmt`'s shape, then close it whatever happened (client
    gone, engine failure). `finish`: run once the response is settled, before its body or
    its stream's last bytes go out (the Responses dialect stores the response there, for
    the client's next turn)."""
    response_id = (getattr(getattr(fmt, "stream", None), "id", None)  # chatcmpl-…, msg_…
                   or getattr(getattr(fmt, "response", None), "id", None))  # resp_…
    if isinstance(response_id, str):
        request.setdefault(RESPONSE_ID, response_id)
    try:
        if not stream:
            return json_response(await complete(run, fmt, finish))
        return await _stream(request, fmt, run, finish)
    finally:
        await run.close()


async def complete(run: Run, fmt: Format,
                   finish: Callable[[], Awaitable[None]] | None = None) -> dict[str, Any]:
    """A started run's non-streamed body in `fmt`'s shape (the caller closes the run)."""
    completions = await run.completions()
    run.settle()  # the body carries the cost the ledger row charges
    body = stamped(fmt.body(run.generated, completions), run.call.timeline, run.call.ticket)
    if finish is not None:
        await finish()
    run.captured(body)
    return body


async def _stream(
    request: web.Request, fmt: Format, run: Run,
    finish: Callable[[], Awaitable[None]] | None = None,
) -> web.StreamResponse:
    response = await open_stream(request)
    run.watch()
    gens = run.gens
    pending = [fmt.encode(event) for event in fmt.head()]
    final: list[Any] = []
    unfinished = len(gens)
    try:
        async for i, out in run.outputs():
            events = fmt.events(i, out)
            unfinished -= out.finished
            if unfinished:
                pending.extend(fmt.encode(event) for event in events)
                if not any(gen.backlog for gen in gens):
                    await _send(request, response, pending)
            else:
                final = events  # held: the very last event carries the timings
    except (ConnectionResetError, asyncio.CancelledError):
        raise  # the client is gone: nothing to tell it
    except Exception as exc:
        err = _stream_failure(request, exc)
        pending.append(fmt.error(err))
        stream_failed(request, response, err)
    else:
        final.extend(fmt.tail(run.generated))
        run.settle()  # metered before the last byte: see the module's docstring
        if final:
            final[-1] = with_timings(final[-1], request)
        if run.capture is not None:
            run.captured(with_timings(fmt.body(run.generated, run.capture.completions),
                                      request))
        pending.extend(fmt.encode(event) for event in final)
        pending.append(fmt.terminator)
    run.settle()  # (a failed stream: settled here, once)
    if finish is not None:
        await finish()
    await _send(request, response, pending)
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
