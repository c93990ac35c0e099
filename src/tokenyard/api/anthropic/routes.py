"""The Anthropic dialect's routes: POST /v1/messages and POST /v1/messages/count_tokens.
A final assistant message is a prefill the model continues (`text/prepare`)."""

from __future__ import annotations

from aiohttp import web

from tokenyard.api.anthropic.convert import (
    anthropic_messages,
    anthropic_request_to_engine,
    cache_pins,
)
from tokenyard.api.anthropic.schemas import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
)
from tokenyard.api.anthropic.stream import MessagesFormat
from tokenyard.api.anthropic.tools import tool_messages, tool_use
from tokenyard.api.context import REQUEST_ID, TIMELINE, read_request, route
from tokenyard.api.images import admit_images
from tokenyard.api.respond import first_user_text, generate, json_response, placed, prepared
from tokenyard.text.content import require_vision
from tokenyard.text.tool_grammar import constrained
from tokenyard.text.tools import template_tools


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    timeline = request[TIMELINE]
    req = await read_request(request, MessagesRequest)
    template_messages, params = anthropic_request_to_engine(req)
    served = route(request, req.model, "chat",
                   first_user_text=first_user_text(template_messages))
    tools, passed_on, native = placed(tool_use(req), served)
    template_messages = tool_messages(req, template_messages, tools, native)
    params = constrained(params, tools)
    template_messages = await admit_images(template_messages, model=served.name,
                                           vision="vision" in served.spec.capabilities)
    prepare, _ = prepared(served)
    prompt = prepare.conversation(template_messages, timeline, prefill=True,
                                  tools=template_tools(tools, native))
    params = prepare.fit(len(prompt), params, "max_tokens")
    # cache_control breakpoints: the prompt prefixes the replica pins (none upstream).
    pins = cache_pins(prepare, req, prompt,
                      served.info.block_size if served.info is not None else None)
    fmt = MessagesFormat(served.name, req.stop_sequences or [], request[REQUEST_ID], pins,
                         tools or passed_on)
    return await generate(request, served, [prompt], [params], fmt,
                          stream=bool(req.stream), messages=template_messages, pins=pins,
                          tools=passed_on)


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the templated prompt's length."""
    req = await read_request(request, CountTokensRequest)
    served = route(request, req.model, "chat")
    tools, _, native = placed(tool_use(req), served)
    template_messages = tool_messages(req, anthropic_messages(req), tools, native)
    require_vision(template_messages, served.name, "vision" in served.spec.capabilities)
    prepare, _ = prepared(served)
    prompt = prepare.conversation(template_messages, request[TIMELINE], prefill=True,
                                  tools=template_tools(tools, native))
    return json_response(CountTokensResponse(input_tokens=len(prompt)))


def add_anthropic_routes(app: web.Application) -> None:
    """The Anthropic dialect's routes on `app`."""
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
