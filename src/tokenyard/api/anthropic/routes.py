"""The Anthropic dialect's routes: POST /v1/messages and POST /v1/messages/count_tokens.
A final assistant message is a prefill the model continues (`text/prepare`)."""

from __future__ import annotations

from aiohttp import web

from tokenyard.api.anthropic.convert import anthropic_messages, anthropic_request_to_engine
from tokenyard.api.anthropic.schemas import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
)
from tokenyard.api.anthropic.stream import MessagesFormat
from tokenyard.api.context import REQUEST_ID, STATE, TIMELINE, read_request
from tokenyard.api.respond import generate, json_response


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    state, timeline = request.app[STATE], request[TIMELINE]
    req = await read_request(request, MessagesRequest)
    template_messages, params = anthropic_request_to_engine(req)
    prompt = state.prepare.conversation(template_messages, timeline, prefill=True)
    params = state.prepare.fit(len(prompt), params, "max_tokens")
    fmt = MessagesFormat(state.model, req.stop_sequences or [], request[REQUEST_ID])
    return await generate(request, req.model, [prompt], [params], fmt,
                          stream=bool(req.stream))


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the templated prompt's length."""
    state = request.app[STATE]
    req = await read_request(request, CountTokensRequest)
    prompt = state.prepare.conversation(anthropic_messages(req), request[TIMELINE],
                                        prefill=True)
    return json_response(CountTokensResponse(input_tokens=len(prompt)))


def add_anthropic_routes(app: web.Application) -> None:
    """The Anthropic dialect's routes on `app`."""
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
