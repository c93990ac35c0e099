"""Background responses over HTTP (`background: true` on POST /v1/responses).

    POST /v1/responses {"background": true, ...}   → the response, status "queued", at
                                                     once (with "stream": its events)
    GET  /v1/responses/{id}                         → the response as it stands: queued,
                                                     in_progress, then completed,
                                                     incomplete, failed or cancelled
    GET  /v1/responses/{id}?stream=true&starting_after=N
                                                   → its events after sequence number N
                                                     (all of them without N), then the
                                                     rest as they come
    POST /v1/responses/{id}/cancel                  → the response, cancelled (again:
                                                     the same; one that ended: 400)

The request is checked as a live one is before it is queued (its body, the items it
continues, the model and the key's right to it), then run by a gateway's background
worker (`gateway/background.py`, `api/responses/background_run.py`), in this process or
in any other sharing the store. A stream opens with response.created and response.queued
(the response queued), then goes on as a live stream does from response.in_progress. A
cancelled response's stream ends after its last event (the API has no cancelled event).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from tokenyard.api.context import KEY, PIPELINE, STATE
from tokenyard.api.edge import EDGE
from tokenyard.api.middleware import open_stream
from tokenyard.api.respond import Plan, json_response, new_call
from tokenyard.api.responses import stored
from tokenyard.api.responses.convert import response_shell
from tokenyard.api.responses.objects import ResponseEvent
from tokenyard.api.responses.schemas import ResponsesRequest
from tokenyard.api.responses.stored import NO_STORE, not_found
from tokenyard.api.sse import sse_event
from tokenyard.errors import APIError, invalid_request
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.background import AT_WORK, QUEUED_EVENTS, Background, BackgroundJob

#: How long a reader waits for events before it looks at the store again (the response
#: may run in another gateway process; this one's worker wakes it at once).
FOLLOW_POLL_S = 0.25
#: The response's states once it has ended (its events are then all written).
ENDED = ("done", "cancelled")

BACKGROUND: web.AppKey[Background] = web.AppKey("tokenyard_background", Background)


def background_of(request: web.Request) -> Background | None:
    """This process's background responses (None: served without a store)."""
    return request.app.get(BACKGROUND)


async def create(request: web.Request, req: ResponsesRequest, plan: Plan,
                 earlier: list[dict[str, Any]]) -> web.StreamResponse:
    """Queue the response `req` asks for (after the `earlier` items; `plan`: its plan, as
    a live response's, which is run later) and answer at once: the response, queued, or
    (with `stream`) its stream from its first event."""
    background = background_of(request)
    if background is None:
        raise invalid_request(f"'background' needs stored responses, but {NO_STORE}.",
                              param="background")
    if req.store is False:
        raise invalid_request("A background response is stored: remove 'store': false.",
                              param="store")
    call = await new_call(request, plan.model, plan.build, **plan.options)
    served = request.app[PIPELINE].route(call)  # 404 unknown model, 403 not the key's
    shell = response_shell(req, served.name, served.sampling)
    shell.status, shell.background, shell.completed_at = "queued", True, None
    events = [ResponseEvent(type=f"response.{kind}", sequence_number=i,
                            response=shell).model_dump(mode="json")
              for i, kind in enumerate(("created", "queued"))]
    assert len(events) == QUEUED_EVENTS
    job = await background.create(request[KEY], response=shell.model_dump(mode="json"),
                                  body=(await request.read()).decode(), earlier=earlier,
                                  events=events)
    if req.stream:
        return await follow(request, background, job.id, -1)
    return json_response(job.response)


async def found(request: web.Request, response_id: str) -> BackgroundJob | None:
    """The background response `response_id`, if the request's key may see it."""
    background = background_of(request)
    return None if background is None else await background.get(request[KEY], response_id)


async def retrieve(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses/{id}: a background response as it stands (with `stream`: its
    events), else a stored one."""
    response_id = request.match_info["response_id"]
    if request.query.get("stream", "false").lower() in ("true", "1"):
        return await stream(request, response_id)
    job = await found(request, response_id)
    if job is None:
        return await stored.retrieve(request)
    return json_response(job.response)


async def delete(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id}: a background one (its run stops) and its stored copy,
    else a stored one."""
    response_id = request.match_info["response_id"]
    background = background_of(request)
    if background is None or not await background.delete(request[KEY], response_id):
        return await stored.delete(request)
    gateway = request.app[STATE].gateway
    if gateway is not None:
        await gateway.responses.delete(request[KEY], response_id)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def stream(request: web.Request, response_id: str) -> web.StreamResponse:
    """GET /v1/responses/{id}?stream=true[&starting_after=N]."""
    background = background_of(request)
    raw = request.query.get("starting_after")
    after = -1
    if raw is not None:
        try:
            after = int(raw)
        except ValueError:
            raise invalid_request(f"Invalid 'starting_after': expected an integer, got "
                                  f"{raw!r}.", param="starting_after",
                                  code="invalid_value") from None
    if background is None or await background.get(request[KEY], response_id) is None:
        if await _stored_elsewhere(request, response_id):
            raise invalid_request("Only a response created with 'background': true can "
                                  "be streamed again.", param="stream")
        raise not_found(response_id, background)
    return await follow(request, background, response_id, after)


async def _stored_elsewhere(request: web.Request, response_id: str) -> bool:
    """Whether the key may see a stored response `response_id` made without background."""
    gateway = request.app[STATE].gateway
    return gateway is not None and await gateway.responses.get(
        request[KEY], response_id) is not None


async def follow(request: web.Request, background: Background, response_id: str,
                 after: int) -> web.StreamResponse:
    """Stream the response's events after sequence number `after` until it ends."""
    key: KeyContext = request[KEY]
    state, events = await background.events_after(key, response_id, after)
    if state is None:
        raise not_found(response_id, background)
    response = await open_stream(request)
    limit = request.app[EDGE].limits.stream_write_timeout_s
    while True:
        if events:
            after = int(events[-1]["sequence_number"])
            data = b"".join(sse_event(str(event["type"]), event) for event in events)
            try:
                async with asyncio.timeout(limit):  # as respond.py's writes
                    await response.write(data)
            except TimeoutError:
                raise ConnectionResetError("the client stopped reading its stream") from None
        if state is None or state in ENDED:
            return response
        await background.wait(response_id, FOLLOW_POLL_S)
        state, events = await background.events_after(key, response_id, after)


async def cancel(request: web.Request) -> web.Response:
    """POST /v1/responses/{id}/cancel."""
    response_id = request.match_info["response_id"]
    background = background_of(request)
    job = await found(request, response_id)
    if background is None or job is None:
        if await _stored_elsewhere(request, response_id):
            raise invalid_request("Only a response created with 'background': true can "
                                  "be cancelled.")
        raise not_found(response_id, background)
    if job.state in AT_WORK:
        await background.cancel(request[KEY], job)
        job = await background.get(request[KEY], response_id) or job
    status = job.response.get("status")
    if job.state != "cancelled":
        raise APIError(400, f"Cannot cancel a response with status '{status}'.",
                       type="invalid_request_error", code="invalid_state")
    return json_response(job.response)
