"""The one response writer of every generating route, whatever its dialect.

A route parses, converts and prepares its request, then hands its prompts, their fitted
parameters and a `Format` (the dialect's shape of this one response) to `generate`, which:

1. admits the request at the gateway (scopes, limits, billing pre-check),
2. starts a generation per prompt on the replica (refusals surface before any byte),
3. answers with the non-streamed body, or streams the format's events as SSE: events of
   one replica step go out in one write, held back while the next step is already in;
   the last event (or the body) carries the request's `timings` and, behind the gateway,
   its `cost`; a failure after the 200 becomes the dialect's error event,
4. settles the ticket with what the generations really used — before the body or a
   stream's last bytes go out, so a response the client saw complete always has its
   ledger row, and its `cost` is that row's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar, cast

from aiohttp import web
from pydantic import BaseModel

from tokenyard.api import moderation, shadow
from tokenyard.api.capture import BodyCapture, capture_of
from tokenyard.api.context import (
    GENERATIONS,
    KEY,
    REQUEST_ID,
    RESPONSE_ID,
    ROUTE,
    STATE,
    TICKET,
    TIMELINE,
    Served,
)
from tokenyard.api.edge import EDGE
from tokenyard.api.middleware import open_stream, stream_failed
from tokenyard.api.sse import to_json
from tokenyard.balancer.generation import Generation, finished_completions, merged
from tokenyard.errors import APIError, internal_error, invalid_request
from tokenyard.gateway.routing import require
from tokenyard.text.prepare import Preparer
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.text.tools import ToolUse, renders_tools
from tokenyard.wire.outputs import Completion, RequestOutput
from tokenyard.wire.protocol import Pin
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


def with_timings(event: BaseModel, request: web.Request) -> dict[str, Any]:
    """A response's last event (or its whole body) with the request's stage durations (ms)
    as `timings` — the Server-Timing figures the header could not hold, since a stream's
    went out before decoding — and, behind the gateway, its `cost`: the ledger row's
    charge with its line items, as decimal strings. (llama.cpp's server puts a `timings`
    object in its last chunk too; SDKs ignore both.)"""
    body = event.model_dump(mode="json")
    body["timings"] = request[TIMELINE].timings_ms()
    ticket = request.get(TICKET)
    if ticket is not None and ticket.cost is not None:
        body["cost"] = ticket.cost.to_json()
    return body


def prepared(served: Served) -> tuple[Preparer, Tokenizer]:
    """The deployment's prepare stage and tokenizer (400 for a kind that has none)."""
    if served.prepare is None or served.tokenizer is None:
        raise invalid_request(f"The model `{served.name}` does not generate text.",
                              param="model", code="model_not_supported")
    return served.prepare, served.tokenizer


_TOKENS: web.RequestKey[Any] = web.RequestKey("upstream_tokens", object)


def token_bytes(request: web.Request, served: Served) -> Callable[[int], bytes]:
    """How the format spells a logprob's token: the tokenizer's bytes for an engine;
    for an upstream, a table of the tokens it returned (shared with its generations)."""
    if served.kind != "upstream":
        assert served.tokenizer is not None
        return served.tokenizer.id_to_token_bytes
    from tokenyard.balancer.upstream_generation import TokenTable

    table = request[_TOKENS] = TokenTable()
    return table


class ToolPlacement(NamedTuple):
    """Where a request's tools go: `prompt` (rendered into it, calls forced by the
    grammar), `passed_on` (in an upstream's body), `native` (the engine's chat template
    renders tools itself; else `text/tools.py`'s system-prompt fallback)."""

    prompt: ToolUse | None
    passed_on: ToolUse | None
    native: bool


def placed(tools: ToolUse | None, served: Served) -> ToolPlacement:
    """Where `tools` go on deployment `served`: an upstream gets active tools passed on,
    an engine in its prompt; 400 naming `tools` for a deployment that does not declare
    them."""
    native = (served.kind != "upstream" and served.tokenizer is not None
              and renders_tools(served.tokenizer.chat_template))
    if tools is None or not tools.active:
        return ToolPlacement(tools, None, native)
    require(served.spec, "tools", "tools")
    if served.kind == "upstream":
        return ToolPlacement(None, tools, native)
    return ToolPlacement(tools, None, native)


def first_user_text(messages: Sequence[Any]) -> str | None:
    """The first user message's text (what a conversation's canary draw sticks to)."""
    for message in messages:
        if message.get("role") == "user":
            return str(message.get("content") or "")
    return None


async def generate(
    request: web.Request, served: Served, prompts: Sequence[list[int]],
    params: Sequence[SamplingParams], fmt: Format, *, stream: bool,
    messages: Sequence[Any] | None = None, texts: Sequence[str | None] | None = None,
    pins: Sequence[Pin] = (), tools: ToolUse | None = None,
    finish: Callable[[], Awaitable[None]] | None = None,
) -> web.StreamResponse:
    """Admit a request of `prompts` (each with its fitted `params`) for deployment
    `served`, answer it in `fmt`'s shape, then settle it whatever happened (client gone,
    engine failure, refusal). `messages` / `texts`: the chat messages or prompt texts,
    for a deployment that takes text rather than token ids (an upstream); `pins`: prompt
    prefixes the replica keeps cached (Anthropic's cache_control); `tools`: passed on to
    an upstream that declares them (an engine sees them in its prompt); `finish`: run
    once the response is settled, before its body or its stream's last bytes go out
    (the Responses dialect stores the response there, for the client's next turn)."""
    response_id = getattr(getattr(fmt, "stream", None), "id", None)  # chatcmpl-…, msg_…
    if isinstance(response_id, str):
        request[RESPONSE_ID] = response_id
    await _admit(request, served, prompts, params)
    capture = await capture_of(request)  # None unless the org captures bodies
    try:  # input moderation (api/moderation.py): a blocked input is refused, unbilled
        await moderation.check_input(request, served, prompts, messages=messages, texts=texts)
    except BaseException:
        _settle(request, [])
        raise
    base_id = request[REQUEST_ID]
    gens = request[GENERATIONS] = [
        _generation(request, served, base_id if len(prompts) == 1 else f"{base_id}-{i}", p,
                    fp, messages=messages, text=texts[i] if texts else None, pins=pins,
                    tools=tools)
        for i, (p, fp) in enumerate(zip(prompts, params, strict=True))
    ]
    # Shadow traffic (api/shadow.py): the copy starts now, in the background; unchanged
    # generations when the route has no shadow.
    gens = shadow.tap(request, served, gens, prompts, params, messages=messages, texts=texts)
    gens = moderation.tap(request, gens)  # output moderation: held back and checked
    try:
        # Sent together: the replica batches them; a refusal of any refuses the request.
        await _each(gens, lambda gen: gen.start())
        if not stream:
            completions = await _each(gens, finished_completions)
            _settle(request, gens)  # the body carries the cost the ledger row charges
            body = with_timings(fmt.body(gens, completions), request)
            if finish is not None:
                await finish()
            if capture is not None:
                capture.send(body)
            return json_response(body)
        return await _stream(request, fmt, gens, finish, capture)
    finally:
        for gen in gens:
            await gen.close()
        _settle(request, gens)
        if capture is not None:
            capture.send(None)  # failed or cancelled: the request alone


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
    request: web.Request, fmt: Format, gens: Sequence[Generation],
    finish: Callable[[], Awaitable[None]] | None = None,
    capture: BodyCapture | None = None,
) -> web.StreamResponse:
    response = await open_stream(request)
    if capture is not None:
        capture.watch(gens)
    pending = [fmt.encode(event) for event in fmt.head()]
    final: list[Any] = []
    unfinished = len(gens)
    try:
        async for i, out in _outputs(gens):
            if capture is not None:
                capture.add(i, out)
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
        final.extend(fmt.tail(gens))
        _settle(request, gens)  # metered before the last byte: see the module's docstring
        if final:
            final[-1] = with_timings(final[-1], request)
        if capture is not None:
            capture.send(with_timings(capture.streamed_body(fmt, gens), request))
        pending.extend(fmt.encode(event) for event in final)
        pending.append(fmt.terminator)
    _settle(request, gens)  # (a failed stream: settled here, once)
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


def _generation(
    request: web.Request, served: Served, request_id: str, prompt: list[int],
    params: SamplingParams, *, messages: Sequence[Any] | None, text: str | None,
    pins: Sequence[Pin] = (), tools: ToolUse | None = None,
) -> Generation:
    """A generation on the deployment's pool for an admitted request, salted and
    prioritised as its gateway ticket says (without a gateway: one tenant, no salt,
    normal priority)."""
    state, ticket = request.app[STATE], request.get(TICKET)
    priority = ticket.priority if ticket is not None else 0
    if served.kind == "upstream":
        from tokenyard.balancer.upstream_generation import UpstreamGeneration

        return cast(Generation, UpstreamGeneration(
            served.pool, request_id, messages=messages, prompt=text, params=params,
            model=served.spec.model or served.name, timeline=request[TIMELINE],
            metrics=state.metrics, prompt_tokens_estimate=len(prompt),
            tokens=request.get(_TOKENS), tools=tools,
        ))
    assert served.tokenizer is not None
    return Generation(
        served.pool, served.tokenizer, request_id, prompt, params,
        timeline=request[TIMELINE], metrics=state.metrics,
        cache_salt=ticket.cache_salt if ticket is not None else None, priority=priority,
        pins=pins,
    )


async def _admit(
    request: web.Request, served: Served, prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
) -> None:
    """The gateway's stages 4–6 (no-op without a gateway); the ticket waits in the
    request for `_settle`. Scopes may name the alias the client used or the deployment;
    prices and the ledger use the deployment."""
    gateway = request.app[STATE].gateway
    if gateway is None:
        return
    chosen = request.get(ROUTE)
    request[TICKET] = await gateway.admit_prompts(
        request[KEY], model=served.name, endpoint=request.path,
        request_id=request[REQUEST_ID], prompts=prompts, params=params,
        timeline=request[TIMELINE], alias=chosen.alias if chosen is not None else None,
    )


def _settle(request: web.Request, gens: Sequence[Generation]) -> None:
    """Settle the request's ticket with what its generations really used, once."""
    gateway, ticket = request.app[STATE].gateway, request.get(TICKET)
    if gateway is not None and ticket is not None:
        gateway.settle(ticket, gens)
