"""The Anthropic dialect's routes: POST /v1/messages and POST /v1/messages/count_tokens.
A final assistant message is a prefill the model continues (`text/prepare`). Each route
converts its body into the pipeline's `Call`; its `build` does the dialect's prompt work
(tool turns, the template with the prefill rule, cache_control pins) for the deployment
the pipeline chose."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tokenyard.api.anthropic import mcp
from tokenyard.api.anthropic.convert import (
    anthropic_messages,
    anthropic_request_to_engine,
    cache_pins,
)
from tokenyard.api.anthropic.request_fields import fallbacks_of
from tokenyard.api.anthropic.schemas import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
)
from tokenyard.api.anthropic.stream import MessagesFormat
from tokenyard.api.anthropic.tools import tool_messages, tool_use
from tokenyard.api.context import read_request
from tokenyard.api.respond import Plan, answer, count, json_response, new_call
from tokenyard.gateway.call import Build, Prepared
from tokenyard.gateway.pipeline import (
    Run,
    Served,
    ToolPlacement,
    first_user_text,
    placed,
    preparer,
    text_size,
)
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.content import TemplateMessage
from tokenyard.text.tools import Tool, template_tools


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    req = await read_request(request, MessagesRequest)
    if mcp.offered(req):  # the platform runs the MCP servers' tools between turns
        converted, _ = anthropic_request_to_engine(req)
        return await mcp.answer_mcp(request, req, messages_plan, first_user_text(converted))
    return await answer(request, messages_plan(req))


def messages_plan(req: MessagesRequest, mcp_part: mcp.McpPart | None = None) -> Plan:
    """A messages request's `Plan` (`mcp_part`: its MCP servers, run by the platform)."""
    converted, _ = anthropic_request_to_engine(req)  # its errors before the pipeline
    extra = mcp_part.tools if mcp_part is not None else ()

    def build(served: Served, timeline: Timeline) -> Prepared:
        template_messages, prompt, (tools, passed_on, _) = _conversation(
            req, converted, served, timeline, extra)
        _, params = anthropic_request_to_engine(req, served.sampling)
        prepare, _ = preparer(served)
        fitted = prepare.fit(len(prompt), prepare.constrained(params, tools), "max_tokens")
        # cache_control breakpoints: the prompt prefixes the replica pins (none upstream).
        pins = cache_pins(prepare, req, prompt,
                          served.info.block_size if served.info is not None else None)
        return Prepared([prompt], [fitted], messages=template_messages, pins=pins,
                        passed_on=passed_on, tools=tools or passed_on)

    def fmt(run: Run) -> MessagesFormat:
        if mcp_part is not None:
            return mcp_part.format(run)
        return MessagesFormat(run.served.name, req.stop_sequences or [], run.call.request_id,
                              run.ready.pins, run.ready.tools,
                              run.served.reasoning_for(run.ready.prompts[0]), run.token_bytes)

    def build_with(changes: dict[str, Any]) -> Build:  # a `fallbacks` entry's own request
        return messages_plan(req.model_copy(update={**changes, "fallbacks": None})).build

    return Plan(req.model, build, fmt, bool(req.stream), dict(
        text_size=text_size(converted), first_user_text=first_user_text(converted),
        fallbacks=fallbacks_of(req.fallbacks, build_with)))


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the templated prompt's length, for a key that may
    use the model and within its request limits (the pipeline's `count`)."""
    req = await read_request(request, CountTokensRequest)
    converted = anthropic_messages(req)

    def build(served: Served, timeline: Timeline) -> Prepared:
        template_messages, prompt, _ = _conversation(req, converted, served, timeline)
        return Prepared([prompt], [], messages=template_messages)

    call = await new_call(request, req.model, build, text_size=text_size(converted))
    return json_response(CountTokensResponse(input_tokens=await count(request, call)))


def _conversation(
    req: MessagesRequest | CountTokensRequest, converted: list[TemplateMessage],
    served: Served, timeline: Timeline, extra: tuple[Tool, ...] = (),
) -> tuple[list[TemplateMessage], list[int], ToolPlacement]:
    """The request's turns with its tools (then `extra`: its MCP servers') where `served`
    takes them, templated with the prefill rule and tokenized: (template messages,
    prompt ids, where the tools went)."""
    placement = placed(tool_use(req, extra), served)
    tools, _, native = placement
    template_messages = tool_messages(req, converted, tools, native)
    prepare, _ = preparer(served)
    prompt = prepare.conversation(template_messages, timeline, prefill=True,
                                  tools=template_tools(tools, native))
    return template_messages, prompt, placement


def add_anthropic_routes(app: web.Application) -> None:
    """The Anthropic dialect's routes on `app`."""
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
