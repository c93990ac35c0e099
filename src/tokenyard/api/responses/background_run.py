"""A background response's run, by the gateway's background worker, without HTTP.

The request is parsed and converted by the live route's own plan (`response_plan`, after
the earlier items kept with it) and run through `Pipeline.run` as a `Call` under the key
that made it, with the response's id as its request id: admitted by the key's limits and
balance, billed once whatever happens to the process running it (the ledger keeps one
row per request id). Its events are the live stream's (`ResponsesFormat`), numbered on
after the two it was queued with, and written to the store as they come; the last one
carries `timings` and `cost` as a live stream's does. A refusal for now (the limits, a
full queue) sends it back to the queue while it is young (`Held.patient`); any other
refusal, or a failure mid-run, ends it `failed` with its error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiohttp import web

from tokenyard.api.context import PIPELINE, STATE
from tokenyard.api.errors import parse_body
from tokenyard.api.lanes import install_lane
from tokenyard.api.request_end import CallEnd
from tokenyard.api.respond import Plan
from tokenyard.api.responses import background as http
from tokenyard.api.responses.conversations import conversation_id
from tokenyard.api.responses.objects import ResponseObject
from tokenyard.api.responses.routes import response_plan
from tokenyard.api.responses.schemas import ResponsesRequest
from tokenyard.api.responses.stream import ResponsesFormat
from tokenyard.errors import APIError, authentication_failed, internal_error
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.background import (
    CANCELLED,
    QUEUED_EVENTS,
    Background,
    BackgroundLane,
    Busy,
    Held,
    Lost,
    Runner,
)
from tokenyard.gateway.batches import busy_wait
from tokenyard.gateway.call import DONE, FLUSH, Call, Failed
from tokenyard.gateway.conversations import Conversations
from tokenyard.gateway.pipeline import Pipeline, Run
from tokenyard.telemetry.timeline import Timeline

logger = logging.getLogger("tokenyard.api.background")

LANE: web.AppKey[BackgroundLane] = web.AppKey("tokenyard_background_lane", BackgroundLane)


def _json(events: list[Any]) -> list[dict[str, Any]]:
    return [e if isinstance(e, dict) else e.model_dump(mode="json") for e in events]


def runner(pipeline: Pipeline, conversations: Conversations) -> Runner:
    """The runner of one claimed background response (see the module's docstring)."""

    async def run(held: Held, key: KeyContext | None) -> None:
        job = held.job
        req = parse_body(ResponsesRequest, job.body.encode())
        kept: list[list[dict[str, Any]]] = []

        async def keep(response: dict[str, Any], items: list[dict[str, Any]]) -> None:
            kept.append(items)  # stored by `Held.finish`, with the response's end

        plan = response_plan(req, job.earlier, keep)
        call = Call(endpoint="/v1/responses", request_id=job.id, timeline=Timeline(),
                    model=plan.model, build=plan.build, key=key, raw=job.body.encode())
        for name, value in plan.options.items():
            setattr(call, name, value)
        # Its end is a live request's: a request record and a log line (its ledger row
        # is its run's settlement); 499 when its client cancelled it here.
        with CallEnd(call, "response_cancelled", lane="background") as end:
            try:
                await _run(held, key, req, call, plan, kept, end)
            except asyncio.CancelledError as exc:
                end.publish = CANCELLED in exc.args  # else this process stops: it reruns
                raise
            except Lost:
                end.publish = False  # its end is another worker's, or a cancel's there
                raise

    async def _run(held: Held, key: KeyContext | None, req: ResponsesRequest, call: Call,
                   plan: Plan, kept: list[list[dict[str, Any]]], end: CallEnd) -> None:
        """The run itself: `end` learns how it ended."""
        job = held.job
        queued = ResponseObject.model_validate(job.response)
        if key is None:
            return await _fail(held, queued, end, authentication_failed(
                "The API key that created this response was revoked or has expired."))
        if held.exhausted:
            return await _fail(held, queued, end, internal_error(
                f"The response was started {job.attempts - 1} times and never finished."))
        try:
            started = await pipeline.run(call)
        except APIError as err:
            wait = busy_wait(err)
            if wait is not None and held.patient:
                end.publish = False  # not its end: it runs again
                raise Busy(wait) from None
            return await _fail(held, queued, end, err)
        fmt = plan.format(started)
        assert isinstance(fmt, ResponsesFormat)
        fmt.after_queue(queued, QUEUED_EVENTS)
        try:
            final = await _generate(held, started, fmt)
            if plan.finish is not None:
                await plan.finish(fmt)  # → keep: the turn's input items
            end.answered()
        except (Lost, asyncio.CancelledError):
            raise
        except Exception as exc:
            failure = exc if isinstance(exc, APIError) else internal_error()
            if not isinstance(exc, APIError):
                logger.exception("background response %s failed", job.id, exc_info=exc)
            final, kept[:] = _json([fmt.failed(failure)]), []
            end.failed(failure)
        finally:
            await started.close()
        items = kept[0] if kept else None
        response = fmt.final or fmt.response.model_dump(mode="json")
        await held.finish(final, response, items)
        if req.conversation is not None and items is not None:
            await conversations.add_items(key, conversation_id(req.conversation),
                                          [*items, *(response.get("output") or [])])

    return run


async def _generate(held: Held, run: Run, fmt: ResponsesFormat) -> list[dict[str, Any]]:
    """Run the generation (`Run.stream`: settled, finished and captured before its last
    events), writing its events as they come; returns the last ones (not written yet:
    they end the response with its final object), the very last stamped with the cost."""
    pending: list[dict[str, Any]] = []
    first, done = True, False
    async with contextlib.aclosing(run.stream(fmt)) as events:
        async for event in events:
            if isinstance(event, Failed):
                raise event.error
            if event is DONE:
                done = True
            elif event is FLUSH:
                if pending and not done:
                    response = fmt.response.model_dump(mode="json") if first else None
                    await held.send(pending, response=response)
                    pending, first = [], False
            else:
                pending.append(event if isinstance(event, dict)
                               else event.model_dump(mode="json"))  # type: ignore[union-attr]
    return pending


async def _fail(held: Held, queued: ResponseObject, end: CallEnd, err: APIError) -> None:
    """End a response that never started with `err` (response.failed)."""
    end.failed(err)
    fmt = ResponsesFormat(queued, None)
    fmt.after_queue(queued, QUEUED_EVENTS)
    event = fmt.failed(err)
    await held.finish(_json([event]), fmt.response.model_dump(mode="json"), None)


def install(app: web.Application) -> None:
    """GET, DELETE and cancel of /v1/responses/{id} on `app`, and, behind a gateway, this
    process's background worker (started and stopped with the application)."""
    app.router.add_get("/v1/responses/{response_id}", http.retrieve)
    app.router.add_delete("/v1/responses/{response_id}", http.delete)
    app.router.add_post("/v1/responses/{response_id}/cancel", http.cancel)

    def lane(app: web.Application) -> BackgroundLane | None:
        state = app[STATE]
        gateway = state.gateway
        if gateway is None:
            return None
        region = gateway.responses.region
        background = app[http.BACKGROUND] = Background(gateway.store, state.background, region)
        return BackgroundLane(background, runner(
            app[PIPELINE], Conversations(gateway.store, region=region)))

    install_lane(app, LANE, lane)
