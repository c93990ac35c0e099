"""The one line runner of both dialects' batches: a line runs exactly as its live route
runs it, without HTTP, and ends as a live request ends.

A line's body is parsed by its route's own schema, converted by the route's own `Plan`,
run through `Pipeline.run` as a `Call` under the batch owner's key — tagged with the
batch, so it runs at the batch priority and is priced at the deployment's batch price,
and with a timeline of the "batch" lane, so its latencies never move the live ones — and
rendered by the route's `Format` through `respond.complete`: the body is the one the
live route returns. Embeddings go through the route's `embedding_body`. A refusal is the
route's error body and status; one that passes (the limits, a full replica queue) is
`Busy`, and the line runs again later.

However it ends — answered, refused, failed, or cut by the batch's cancel — the line's
run is closed (settled: its ledger row), `spent` gets what it was billed for, and its
summary is published like a live request's (`request_end.call_ended`: its request record
and its log line). Only the dialect's shape of a result line differs: a `Shape`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Protocol

from pydantic import BaseModel

from tokenyard.api.batch.lines import ROUTES, Batchable
from tokenyard.api.context import AppState
from tokenyard.api.errors import parse_body
from tokenyard.api.openai.embeddings import (
    EmbeddingRequest,
    embedding_body,
    embedding_options,
    no_prompt,
)
from tokenyard.api.request_end import CallEnd
from tokenyard.api.respond import Plan
from tokenyard.api.responses.routes import response_plan
from tokenyard.api.responses.schemas import ResponsesRequest
from tokenyard.api.responses.stored import expand_with
from tokenyard.errors import APIError, authentication_failed, internal_error
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.batches import (
    BatchRecord,
    Busy,
    Claimed,
    LineEnd,
    LineResult,
    Spent,
    busy_wait,
    line_request_id,
)
from tokenyard.gateway.call import Call
from tokenyard.gateway.pipeline import Pipeline
from tokenyard.telemetry.timeline import Timeline

logger = logging.getLogger("tokenyard.api.batches")


class Shape(Protocol):
    """A dialect's result line of one batch line, and its batch's result files."""

    def succeeded(self, line: Claimed, request_id: str, body: dict[str, Any]) -> str:
        """The stored result of a line answered with `body` (status 200)."""
        ...

    def errored(self, line: Claimed, request_id: str, err: APIError) -> tuple[int, str]:
        """The status and stored result of a line refused or failed with `err`."""
        ...

    def result_files(self, record: BatchRecord, results: Sequence[LineResult],
                     status: str) -> list[tuple[str, str, bytes]]:
        """The ended batch's files: (column, file name, bytes) each."""
        ...


class Runner:
    """The `LineRunner` the lane is given: runs any line through `pipeline` over
    `state`'s fleet, its result in its batch's dialect's `Shape`."""

    def __init__(self, pipeline: Pipeline, state: AppState,
                 shapes: Mapping[str, Shape]) -> None:
        self.pipeline, self.state, self.shapes = pipeline, state, shapes

    def result_files(self, record: BatchRecord, results: Sequence[LineResult],
                     status: str) -> list[tuple[str, str, bytes]]:
        return self.shapes[record.dialect].result_files(record, results, status)

    async def run(self, line: Claimed, key: KeyContext | None, spent: Spent) -> LineEnd:
        shape = self.shapes[line.dialect]
        request_id = line_request_id(line.batch_id, line.line)
        call = Call(endpoint=line.endpoint, request_id=request_id,
                    timeline=Timeline(lane="batch"), model="", build=no_prompt, key=key,
                    raw=line.body.encode(), batch=line.batch_id)
        # Unless the run gets further: cut by the batch's cancel.
        with CallEnd(call, "batch_cancelled") as end:
            try:
                body = await self._answer(call, line, key)
                end.answered()
                result = shape.succeeded(line, request_id, body)
            except APIError as err:
                wait = busy_wait(err)
                if wait is not None:
                    end.publish = False  # not its end: it runs again
                    raise Busy(wait) from None
                status, result = shape.errored(line, request_id, err)
                end.failed(err, status)
            except Exception:
                logger.exception("batch %s line %d failed", line.batch_id, line.line)
                failure = internal_error()
                status, result = shape.errored(line, request_id, failure)
                end.failed(failure, status)
            finally:
                ticket = call.ticket
                spent.usage = ticket.usage if ticket is not None else None
        return spent.end(line, end.status, result)

    async def _answer(self, call: Call, line: Claimed,
                      key: KeyContext | None) -> dict[str, Any]:
        """The line's response body, as its route renders it; its refusal raised."""
        if key is None:
            raise authentication_failed(
                "The API key that created this batch was revoked or has expired.")
        route = ROUTES[line.endpoint]
        req = parse_body(route.schema, call.raw or b"")
        call.model = getattr(req, "model", "")
        if route.plan is None:
            assert isinstance(req, EmbeddingRequest)
            for name, value in embedding_options(req).items():
                setattr(call, name, value)
            return await embedding_body(self.pipeline, self.state, req, call)
        plan = self._plan(req, route, key)
        plan = await plan if not isinstance(plan, Plan) else plan
        call.build = plan.build
        for name, value in plan.options.items():
            setattr(call, name, value)
        run = await self.pipeline.run(call)
        try:
            fmt = plan.format(run)
            return await run.complete(fmt, plan.finisher(fmt))
        finally:
            await run.close()  # also when the batch's cancel cuts it: settled as it ran

    def _plan(self, req: BaseModel, route: Batchable,
              key: KeyContext) -> Plan | Awaitable[Plan]:
        """The line's plan; a Responses line continues its previous response and is stored
        as the live route stores it."""
        if not isinstance(req, ResponsesRequest):
            assert route.plan is not None
            return route.plan(req)
        gateway = self.state.gateway
        responses = gateway.responses if gateway is not None else None

        async def keep(response: dict[str, Any], items: list[dict[str, Any]]) -> None:
            if responses is not None:
                await responses.save(key, response, items)

        async def planned() -> Plan:
            earlier = ([] if req.previous_response_id is None
                       else await expand_with(responses, key, req.previous_response_id))
            return response_plan(req, earlier, keep)

        return planned()
