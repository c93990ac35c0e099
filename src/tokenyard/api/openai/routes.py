"""The OpenAI dialect's routes: POST /v1/chat/completions, POST /v1/completions and
GET /v1/models. Each parses and converts its body, prepares its prompts (`text/prepare`)
and hands them to the one response writer with its dialect's `Format`."""

from __future__ import annotations

from aiohttp import web

from tokenyard.api.context import STATE, TIMELINE, read_request, route
from tokenyard.api.images import admit_images
from tokenyard.api.openai.convert import (
    build_model_list,
    chat_request_to_engine,
    completion_request_to_engine,
)
from tokenyard.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from tokenyard.api.openai.stream import ChatFormat, CompletionFormat
from tokenyard.api.openai.tools import tool_messages, tool_use
from tokenyard.api.respond import generate, json_response, placed, prepared, token_bytes
from tokenyard.text.tool_grammar import constrained
from tokenyard.text.tools import template_tools


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    timeline = request[TIMELINE]
    req = await read_request(request, ChatCompletionRequest)
    served = route(request, req.model, "chat",
                   first_user_text=next((m.text for m in req.messages if m.role == "user"), None))
    messages, params = chat_request_to_engine(req, served.vocab_size)
    tools, passed_on, native = placed(tool_use(req), served)
    messages = tool_messages(req, messages, tools, native)
    params = constrained(params, tools)
    messages = await admit_images(messages, model=served.name,
                                  vision="vision" in served.spec.capabilities)
    prepare, _ = prepared(served)
    prompt = prepare.conversation(messages, timeline, prefill=False,
                                  tools=template_tools(tools, native))
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "messages"
    params = prepare.fit(len(prompt), params, param)
    fmt = ChatFormat(served.name, params.n, req.include_usage, token_bytes(request, served),
                     tools or passed_on)
    return await generate(request, served, [prompt], [params], fmt,
                          stream=bool(req.stream), messages=messages, tools=passed_on)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions (several prompts: choice i*n+j is completion j of prompt i)."""
    timeline = request[TIMELINE]
    req = await read_request(request, CompletionRequest)
    served = route(request, req.model, "completions")
    prompts, params = completion_request_to_engine(req, served.vocab_size)
    prepare, tok = prepared(served)
    ids = [prepare.encode_prompt(p) for p in prompts]
    timeline.mark("tokenized")
    fitted = [prepare.fit(len(p), params, "max_tokens") for p in ids]
    echo = [p if isinstance(p, str) else tok.decode(p) for p in prompts] if req.echo else None
    fmt = CompletionFormat(served.name, params.n, req.include_usage,
                           token_bytes(request, served), echo)
    return await generate(request, served, ids, fitted, fmt, stream=bool(req.stream),
                          texts=[p if isinstance(p, str) else None for p in prompts])


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: every deployment, then every alias."""
    state = request.app[STATE]
    return json_response(build_model_list(
        [(s.name, s.created, "tokenyard") for s in state.deployments.values()]
        + [(alias, state.created, "tokenyard") for alias in state.router.fleet.aliases]))


def add_openai_routes(app: web.Application) -> None:
    """The OpenAI dialect's routes on `app`."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
