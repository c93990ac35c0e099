"""The routes a batch line may name, and what a line's body is checked with.

A line is parsed by its route's own schema (`parse_body`) and converted by the route's
own `Plan` (`chat_plan`, `completion_plan`, `response_plan`, `messages_plan`; None for
embeddings, which go through `embedding_body`). `check` is what upload and creation run
on a line: the route's parse and conversion (a body the route would refuse is refused
there); `api/batch/runner.py` runs it the same way. `sort_key`, `estimate_tokens` and
`model_of` are what a batch's creation stores of its lines.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tokenyard.api.anthropic.routes import messages_plan
from tokenyard.api.anthropic.schemas import MessagesRequest
from tokenyard.api.errors import parse_body
from tokenyard.api.openai.embeddings import EmbeddingRequest
from tokenyard.api.openai.routes import chat_plan, completion_plan
from tokenyard.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from tokenyard.api.respond import Plan
from tokenyard.api.responses.routes import response_plan
from tokenyard.api.responses.schemas import ResponsesRequest
from tokenyard.errors import invalid_request


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


def model_of(bodies: Sequence[dict[str, Any]]) -> str | None:
    """The model a batch's lines name (the batch object's `model`): its first line's."""
    for body in bodies:
        if isinstance(body.get("model"), str):
            return str(body["model"])
    return None
