"""The one response writer of every generating route, whatever its dialect.

A route parses, converts and prepares its request, then hands its prompts, their fitted
parameters and a `Format` (the dialect's shape of this one response) to `generate`, which:

1. admits the request at the gateway (scopes, limits, billing pre-check),
2. starts a generation per prompt on the replica (refusals surface before any byte),
3. answers with the non-streamed body, or streams the format's events as SSE: events of
   one replica step go out in one write, held back while the next step is already in;
   the last event carries the request's `timings`; a failure after the 200 becomes the
   dialect's error event,
4. settles the ticket with what the generations really used — for a stream, before its
   last bytes go out, so a response the client saw complete always has its ledger row.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from aiohttp import web
from pydantic import BaseModel

from tokenyard.api.context import KEY, REQUEST_ID, STATE, TICKET, TIMELINE
from tokenyard.api.middleware import open_stream, stream_failed
from tokenyard.api.sse import to_json
from tokenyard.balancer.generation import Generation, finished_completions, merged
from tokenyard.errors import APIError, internal_error
from tokenyard.telemetry.timeline import Timeline
from tokenyard.wire.outputs import Completion, RequestOutput
from tokenyard.wire.sampling_params import SamplingParams

logger = logging.getLogger("tokenyard.api")

_T = TypeVar("_T")


class Format(Protocol):
    """One response in one dialect's shape. Events are pydantic models (or their JSON
    with `timings` added) until `encode` makes them SSE bytes."""

    #: Bytes after the last event (OpenAI's ``data: [DONE]``), or b"".
    terminator: bytes

    def body(
        self, gens: Sequence[Generation], completions: Sequence[list[Completion]]
    ) -> BaseModel:
        """The non-streamed body; `completions[i]` are prompt i's finished choices."""
        ...

    def head(self) -> list[BaseModel]:
        """Events that go out with the first step's output, before its own."""
        ...

    def events(self, index: int, out: RequestOutput) -> list[BaseModel]:
        """The events of one step's output of prompt `index`."""
        ...

    def tail(self, gens: Sequence[Generation]) -> list[BaseModel]:
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


def with_timings(event: BaseModel, timeline: Timeline) -> dict[str, Any]:
    """A stream's last event with the request's stage durations (ms) as `timings` — the
    Server-Timing figures the header could not hold, since it went out before decoding.
    (llama.cpp's server puts a `timings` object in its last chunk too; SDKs ignore it.)"""
    body = event.model_dump(mode="json")
    body["timings"] = timeline.timings_ms()
    return body


async def generate(
    request: web.Request, model: str, prompts: Sequence[list[int]],
    params: Sequence[SamplingParams], fmt: Format, *, stream: bool,
) -> web.StreamResponse:
    """Admit a request of `prompts` (each with its fitted `params`), answer it in `fmt`'s
    shape, then settle it whatever happened (client gone, engine failure, refusal)."""
    await _admit(request, model, prompts, params)
    base_id = request[REQUEST_ID]
    gens = [
        _generation(request, base_id if len(prompts) == 1 else f"{base_id}-{i}", p, fp)
        for i, (p, fp) in enumerate(zip(prompts, params, strict=True))
    ]
    try:
        # Sent together: the replica batches them; a refusal of any refuses the request.
        await _each(gens, Generation.start)
        if not stream:
            return json_response(fmt.body(gens, await _each(gens, finished_completions)))
        return await _stream(request, fmt, gens)
    finally:
        for gen in gens:
            await gen.close()
        _settle(request, gens)


async def _each(
    gens: Sequence[Generation], fn: Callable[[Generation], Awaitable[_T]]
) -> list[_T]:
    """`fn(gen)` for every generation, concurrently (no task for a lone one)."""
    if len(gens) == 1:
        return [await fn(gens[0])]
    return list(await asyncio.gather(*(fn(gen) for gen in gens)))


async def _outputs(gens: Sequence[Generation]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every generation's outputs as they arrive, tagged with its position."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
    else:
        async for item in merged(gens):
            yield item


async def _stream(
    request: web.Request, fmt: Format, gens: Sequence[Generation]
) -> web.StreamResponse:
    response = await open_stream(request)
    pending = [fmt.encode(event) for event in fmt.head()]
    final: list[Any] = []
    unfinished = len(gens)
    try:
        async for i, out in _outputs(gens):
            events = fmt.events(i, out)
            unfinished -= out.finished
            if unfinished:
                pending.extend(fmt.encode(event) for event in events)
                if not any(gen.backlog for gen in gens):
                    await _send(response, pending)
            else:
                final = events  # held: the very last event carries the timings
    except (ConnectionResetError, asyncio.CancelledError):
        raise  # the client is gone: nothing to tell it
    except Exception as exc:
        pending.append(fmt.error(_stream_failure(request, exc)))
        stream_failed(response)
    else:
        final.extend(fmt.tail(gens))
        if final:
            final[-1] = with_timings(final[-1], request[TIMELINE])
        pending.extend(fmt.encode(event) for event in final)
        pending.append(fmt.terminator)
    _settle(request, gens)  # metered before the last byte: see the module's docstring
    await _send(response, pending)
    return response


async def _send(response: web.StreamResponse, pending: list[bytes]) -> None:
    """Write the events in `pending` in one write (one syscall, one HTTP chunk) and
    empty it; nothing when it is empty."""
    if pending:
        data = b"".join(pending)
        pending.clear()
        await response.write(data)


def _stream_failure(request: web.Request, exc: Exception) -> APIError:
    """The error event for a failure after a stream began (logged unless the API's own)."""
    if isinstance(exc, APIError):
        return exc
    logger.exception("stream of %s failed", request.get(REQUEST_ID), exc_info=exc)
    return internal_error()


def _generation(
    request: web.Request, request_id: str, prompt: list[int], params: SamplingParams
) -> Generation:
    """A generation on the replica for an admitted request, salted and prioritised as
    its gateway ticket says (without a gateway: one tenant, no salt, normal priority)."""
    state, ticket = request.app[STATE], request.get(TICKET)
    return Generation(
        state.client, state.tokenizer, request_id, prompt, params,
        timeline=request[TIMELINE], metrics=state.metrics,
        cache_salt=ticket.cache_salt if ticket is not None else None,
        priority=ticket.priority if ticket is not None else 0,
    )


async def _admit(
    request: web.Request, model: str, prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
) -> None:
    """The gateway's stages 4–6 (no-op without a gateway); the ticket waits in the
    request for `_settle`."""
    gateway = request.app[STATE].gateway
    if gateway is None:
        return
    request[TICKET] = await gateway.admit_prompts(
        request[KEY], model=model, endpoint=request.path,
        request_id=f"req_{uuid.uuid4().hex}", prompts=prompts, params=params,
        timeline=request[TIMELINE],
    )


def _settle(request: web.Request, gens: Sequence[Generation]) -> None:
    """Settle the request's ticket with what its generations really used, once."""
    gateway, ticket = request.app[STATE].gateway, request.get(TICKET)
    if gateway is not None and ticket is not None:
        gateway.settle(ticket, gens)
