"""The OpenAI dialect's routes: POST /v1/chat/completions, POST /v1/completions and
GET /v1/models. Each parses and converts its body, prepares its prompts (`text/prepare`)
and hands them to the one response writer with its dialect's `Format`."""

from __future__ import annotations

from aiohttp import web

from tokenyard.api.context import STATE, TIMELINE, read_request
from tokenyard.api.openai.convert import (
    build_model_list,
    chat_request_to_engine,
    completion_request_to_engine,
)
from tokenyard.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from tokenyard.api.openai.stream import ChatFormat, CompletionFormat
from tokenyard.api.respond import generate, json_response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    state, timeline = request.app[STATE], request[TIMELINE]
    req = await read_request(request, ChatCompletionRequest)
    messages, params = chat_request_to_engine(req, state.info.vocab_size)
    prompt = state.prepare.conversation(messages, timeline, prefill=False)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "messages"
    params = state.prepare.fit(len(prompt), params, param)
    fmt = ChatFormat(state.model, params.n, req.include_usage,
                     state.tokenizer.id_to_token_bytes)
    return await generate(request, req.model, [prompt], [params], fmt,
                          stream=bool(req.stream))


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions (several prompts: choice i*n+j is completion j of prompt i)."""
    state, timeline = request.app[STATE], request[TIMELINE]
    req = await read_request(request, CompletionRequest)
    prompts, params = completion_request_to_engine(req, state.info.vocab_size)
    ids = [state.prepare.encode_prompt(p) for p in prompts]
    timeline.mark("tokenized")
    fitted = [state.prepare.fit(len(p), params, "max_tokens") for p in ids]
    tok = state.tokenizer
    echo = [p if isinstance(p, str) else tok.decode(p) for p in prompts] if req.echo else None
    fmt = CompletionFormat(state.model, params.n, req.include_usage,
                           tok.id_to_token_bytes, echo)
    return await generate(request, req.model, ids, fitted, fmt, stream=bool(req.stream))


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: the replica's model."""
    state = request.app[STATE]
    return json_response(build_model_list([(state.model, state.created, "tokenyard")]))


def add_openai_routes(app: web.Application) -> None:
    """The OpenAI dialect's routes on `app`."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
