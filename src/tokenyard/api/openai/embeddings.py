"""POST /v1/embeddings, in OpenAI's shape, served by a deployment's embeddings pool.

`input` is a string, a list of strings, a list of token ids or a list of token-id lists
(ids are the model's input as given: WordPiece ids, `[CLS]`/`[SEP]` included as its
tokenizer adds them). Texts are tokenized here, with the replica's own tokenizer, so the
gateway admits the exact prompt tokens (no output tokens); an input longer than the model
takes is a 400 naming `input`, never truncated. `encoding_format` "base64" is the
little-endian float32 bytes the openai SDK decodes; `dimensions` must be the model's own
(all-MiniLM-L6-v2 was not trained to be shortened).
"""

from __future__ import annotations

from typing import Any, Literal

from aiohttp import web
from pydantic import Field, model_validator

from tokenyard.api.context import KEY, REQUEST_ID, STATE, TICKET, TIMELINE, read_request, route
from tokenyard.api.errors import schema_error
from tokenyard.api.respond import json_response
from tokenyard.api.schemas import RequestModel, reject_unknown
from tokenyard.balancer.generation import replica_error
from tokenyard.balancer.replica_client import ReplicaError
from tokenyard.errors import INVALID_VALUE, invalid_request
from tokenyard.gateway.billing import Usage
from tokenyard.gateway.pipeline import ABORTED, COMPLETED, FAILED, Ticket
from tokenyard.wire.embeddings import EmbedResult, unpack_floats

#: The most inputs one request may hold (OpenAI's own limit).
MAX_INPUTS = 2048

Input = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(RequestModel):
    """The body of POST /v1/embeddings."""

    input: Input
    model: str
    # null is the default, as OpenAI takes it: litellm sends `"encoding_format": null`.
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        reject_unknown(data, cls.model_fields)
        return data

    @model_validator(mode="after")
    def _inputs_present(self) -> EmbeddingRequest:
        items = [self.input] if isinstance(self.input, str) else self.input
        if not items:
            raise schema_error(INVALID_VALUE, "input", "'input' must not be empty.")
        if len(items) > MAX_INPUTS:
            raise schema_error(INVALID_VALUE, "input",
                               f"'input' may hold at most {MAX_INPUTS} items.")
        for i, item in enumerate(items):
            if isinstance(item, str | list) and not item:
                where = "input" if isinstance(self.input, str) else f"input.{i}"
                raise schema_error(INVALID_VALUE, where,
                                   "An input must not be empty (a string or token list).")
        return self

    def inputs(self) -> tuple[list[str] | None, list[list[int]] | None]:
        """(texts, None) or (None, token-id lists), one entry per input."""
        data = self.input
        if isinstance(data, str):
            return [data], None
        if isinstance(data[0], str):
            return list(data), None
        if isinstance(data[0], int):
            return None, [list(data)]
        return None, [list(ids) for ids in data]


def _check_inputs(ids: list[list[int]], max_tokens: int, vocab_size: int) -> None:
    """400 naming `input` for an input longer than the model takes or an id outside its
    vocabulary."""
    for i, tokens in enumerate(ids):
        if len(tokens) > max_tokens:
            raise invalid_request(
                f"This model's maximum context length is {max_tokens} tokens, however input "
                f"{i} has {len(tokens)} tokens. Please reduce the length of the input.",
                param="input", code="context_length_exceeded")
        if any(not 0 <= t < vocab_size for t in tokens):
            raise invalid_request(f"Invalid token id in input {i}: ids must be in "
                                  f"[0, {vocab_size}).", param="input", code=INVALID_VALUE)


def _body(result: EmbedResult, model: str, encoding: str | None) -> dict[str, Any]:
    """OpenAI's response: a list of embeddings with their index, and the usage."""
    vector: Any = (lambda i: result.embeddings[i]) if encoding == "base64" else (
        lambda i: unpack_floats(result.embeddings[i]))
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": vector(i)}
                 for i in range(len(result.embeddings))],
        "model": model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }


async def embeddings(request: web.Request) -> web.Response:
    """POST /v1/embeddings."""
    state, timeline = request.app[STATE], request[TIMELINE]
    req = await read_request(request, EmbeddingRequest)
    served = route(request, req.model, "embeddings")
    target = state.embeddings[served.name]
    try:
        model = await target.info()
    except ReplicaError as exc:
        raise replica_error(exc) from None
    if req.dimensions is not None and req.dimensions != model.dimensions:
        raise invalid_request(
            f"This model only supports {model.dimensions} dimensions; 'dimensions' "
            f"{req.dimensions} is not supported.", param="dimensions", code=INVALID_VALUE)
    texts, ids = req.inputs()
    if texts is not None:
        ids = model.tokenize(texts)
    assert ids is not None
    _check_inputs(ids, model.max_tokens, model.vocab_size)
    timeline.mark("tokenized")
    ticket = await _admit(request, served.name, ids)
    result: EmbedResult | None = None
    failed = False
    try:
        queued = timeline.mark("queued")
        result = await target.call(
            lambda client: client.embed(request[REQUEST_ID], ids),
            cost=sum(len(t) for t in ids), timeline=timeline,
            priority=ticket.priority if ticket is not None else 0,
        )
        timeline.mark("admitted", queued + int(result.queue_ms * 1e6))
        timeline.add("embed", int(result.forward_ms * 1e6))
    except ReplicaError as exc:
        failed = True
        raise replica_error(exc) from None
    finally:
        _settle(request, ticket, result, failed)
    return json_response(_body(result, served.name, req.encoding_format))


async def _admit(request: web.Request, model: str, ids: list[list[int]]) -> Ticket | None:
    """The gateway's stages 4–6 for the inputs' tokens (no output); None without one."""
    gateway = request.app[STATE].gateway
    if gateway is None:
        return None
    ticket = await gateway.admit(
        request[KEY], model=model, endpoint=request.path, request_id=request[REQUEST_ID],
        prompt_tokens=sum(len(t) for t in ids), max_tokens=0,
        context_tokens=max(len(t) for t in ids), timeline=request[TIMELINE],
    )
    request[TICKET] = ticket
    return ticket


def _settle(request: web.Request, ticket: Ticket | None, result: EmbedResult | None,
            failed: bool) -> None:
    """Settle and meter the request: its prompt tokens if it was embedded, else nothing."""
    gateway = request.app[STATE].gateway
    if gateway is None or ticket is None:
        return
    if result is None:
        gateway.finish(ticket, None, FAILED if failed else ABORTED)
    else:
        gateway.finish(ticket, Usage(prompt_tokens=result.prompt_tokens, cached_tokens=0,
                                     output_tokens=0), COMPLETED)


def add_embeddings_routes(app: web.Application) -> None:
    """POST /v1/embeddings on `app`."""
    app.router.add_post("/v1/embeddings", embeddings)



