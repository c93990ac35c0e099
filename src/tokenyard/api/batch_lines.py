"""One batch line, parsed and run exactly as its live route runs it, without HTTP.

A line's body is parsed by the route's own schema (`parse_body`), converted by the
route's own `Plan` (`chat_plan`, `completion_plan`, `response_plan`, `messages_plan`),
run through `Pipeline.run` as a `Call` under the batch owner's key — tagged with the
batch, so it runs at the batch priority and is priced at the batch price — and
rendered by the route's `Format` through `Run.complete`: the body is the one the
live route returns. Embeddings go through the route's `embedding_body`. A refusal is
the route's error body and status. `check` is what upload and creation run on a line:
the route's parse and conversion (a body the route would refuse is refused there).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tokenyard.api.anthropic.routes import messages_plan
from tokenyard.api.anthropic.schemas import MessagesRequest
from tokenyard.api.context import AppState
from tokenyard.api.errors import parse_body
from tokenyard.api.openai.embeddings import (
    EmbeddingRequest,
    embedding_body,
    embedding_options,
    no_prompt,
)
from tokenyard.api.openai.routes import chat_plan, completion_plan
from tokenyard.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from tokenyard.api.respond import Plan
from tokenyard.api.responses.routes import response_plan
from tokenyard.api.responses.schemas import ResponsesRequest
from tokenyard.api.responses.stored import expand_with
from tokenyard.errors import APIError, authentication_failed, internal_error, invalid_request
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.batches import Claimed, line_request_id
from tokenyard.gateway.call import Call
from tokenyard.gateway.pipeline import Pipeline
from tokenyard.telemetry.timeline import Timeline

logger = logging.getLogger("tokenyard.api.batches")


async def _no_keep(response: dict[str, Any], items: list[dict[str, Any]]) -> None:
    return None


def _responses_plan(req: BaseModel) -> Plan:
    assert isinstance(req, ResponsesRequest)
    return response_plan(req, [], _no_keep)


@dataclass(frozen=True)
class Batchable:
    """A batchable route: its schema and its plan (None: embeddings)."""

    schema: type[BaseModel]
    plan: Callable[[Any], Plan] | None


#: The routes a batch line may name.
ROUTES: dict[str, Batchable] = {
    "/v1/chat/completions": Batchable(ChatCompletionRequest, chat_plan),
    "/v1/completions": Batchable(CompletionRequest, completion_plan),
    "/v1/embeddings": Batchable(EmbeddingRequest, None),
    "/v1/responses": Batchable(ResponsesRequest, _responses_plan),
    "/v1/messages": Batchable(MessagesRequest, messages_plan),
}


def check(endpoint: str, body: Any) -> BaseModel:
    """The line's body as its route parses and converts it (the route's 400 if it
    would refuse it); a stream is refused: a batch's results are whole bodies."""
    route = ROUTES[endpoint]
    raw = json.dumps(body).encode() if not isinstance(body, bytes) else body
    req = parse_body(route.schema, raw)
    if getattr(req, "stream", None):
        raise invalid_request("A batch request cannot stream: remove 'stream'.",
                              param="stream")
    if route.plan is not None:
        route.plan(req)
    return req


def sort_key(body: dict[str, Any]) -> str:
    """Lines whose prompts open alike sort together (their shared prefix then hits the
    replica's cache): a hash of the model and the prompt's first message or input."""
    first: Any = None
    for name in ("system", "instructions", "messages", "prompt", "input"):
        value = body.get(name)
        if value:
            first = value[0] if isinstance(value, list) else value
            break
    text = json.dumps([body.get("model"), first], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def estimate_tokens(body: dict[str, Any], raw_size: int) -> int:
    """A line's tokens for the enqueued-token quota, before any tokenizer: its bytes / 4
    (about a token per 4 bytes of English) plus the most it may generate."""
    most = 0
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if isinstance(value, int):
            most = max(most, value)
    return raw_size // 4 + most



async def run_line(pipeline: Pipeline, state: AppState, line: Claimed,
                   key: KeyContext | None, endpoint: str) -> tuple[int, dict[str, Any]]:
    """Run one line: (its status code, its body: the route's response or error body in
    the OpenAI shape unless `endpoint` is /v1/messages). Raises the APIError of a
    refusal for the caller to render."""
    if key is None:
        raise authentication_failed(
            "The API key that created this batch was revoked or has expired.")
    route = ROUTES[endpoint]
    raw = line.body.encode()
    req = parse_body(route.schema, raw)
    call = Call(endpoint=endpoint, request_id=line_request_id(line.batch_id, line.line),
                timeline=Timeline(), model=getattr(req, "model", ""), build=no_prompt,
                key=key, raw=raw, batch=line.batch_id)
    if route.plan is None:
        assert isinstance(req, EmbeddingRequest)
        for name, value in embedding_options(req).items():
            setattr(call, name, value)
        return 200, await embedding_body(pipeline, state, req, call)
    plan = _plan(req, route, state, key)
    plan = await plan if not isinstance(plan, Plan) else plan
    call.build = plan.build
    for name, value in plan.options.items():
        setattr(call, name, value)
    run = await pipeline.run(call)
    try:
        fmt = plan.format(run)
        return 200, await run.complete(fmt, plan.finisher(fmt))
    finally:
        await run.close()


def _plan(req: BaseModel, route: Batchable, state: AppState,
          key: KeyContext) -> Plan | Awaitable[Plan]:
    """The line's plan; a Responses line continues its previous response and is stored
    as the live route stores it."""
    if not isinstance(req, ResponsesRequest):
        assert route.plan is not None
        return route.plan(req)
    responses = state.gateway.responses if state.gateway is not None else None

    async def keep(response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        if responses is not None:
            await responses.save(key, response, items)

    async def planned() -> Plan:
        earlier = ([] if req.previous_response_id is None
                   else await expand_with(responses, key, req.previous_response_id))
        return response_plan(req, earlier, keep)

    return planned()


async def guarded(work: Awaitable[tuple[int, dict[str, Any]]], line: Claimed,
                  ) -> tuple[int, dict[str, Any] | None, APIError | None]:
    """`work`'s status and body, or the APIError it raised (an unexpected failure as the
    internal error a live route answers with)."""
    try:
        status, body = await work
        return status, body, None
    except APIError as err:
        return err.status, None, err
    except Exception:
        logger.exception("batch %s line %d failed", line.batch_id, line.line)
        failure = internal_error()
        return failure.status, None, failure
