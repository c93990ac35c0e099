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

from tokenyard.api.context import PIPELINE, STATE, AppState, read_request
from tokenyard.api.errors import schema_error
from tokenyard.api.respond import json_response, new_call, note
from tokenyard.api.schemas import RequestModel, reject_unknown
from tokenyard.errors import INVALID_VALUE
from tokenyard.gateway.call import Call, Prepared
from tokenyard.gateway.embed import embed
from tokenyard.gateway.pipeline import Pipeline, Served
from tokenyard.telemetry.timeline import Timeline
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
    req = await read_request(request, EmbeddingRequest)
    call = await new_call(request, req.model, no_prompt, **embedding_options(req))
    try:
        body = await embedding_body(request.app[PIPELINE], request.app[STATE], req, call)
    finally:
        note(request, call)
    return json_response(body)


def embedding_options(req: EmbeddingRequest) -> dict[str, Any]:
    """The rest of an embeddings request's `Call` (its model and build aside)."""
    texts, _ = req.inputs()
    return dict(capability="embeddings", text_size=sum(map(len, texts or ())),
                param="input")


async def embedding_body(pipeline: Pipeline, state: AppState, req: EmbeddingRequest,
                         call: Call) -> dict[str, Any]:
    """Embed `req` through the pipeline as `call`: OpenAI's response body."""
    texts, ids = req.inputs()
    result = await embed(pipeline, call, texts=texts, ids=ids, dimensions=req.dimensions)
    assert call.served is not None
    return _body(result, call.served.name, req.encoding_format)


def no_prompt(served: Served, timeline: Timeline) -> Prepared:
    raise AssertionError("an embeddings call has no chat prompt to build")


def add_embeddings_routes(app: web.Application) -> None:
    """POST /v1/embeddings on `app`."""
    app.router.add_post("/v1/embeddings", embeddings)



