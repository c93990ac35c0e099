"""The Responses dialect's route: POST /v1/responses. It expands `previous_response_id`
into the earlier turns' items, converts the conversation like chat's (tools, images,
the text format's grammar) into the pipeline's `Call`, whose `build` prepares the prompt
for the chosen deployment, and renders the run with the dialect's `Format`; a response
to keep (`store`, the default) is stored before its last bytes go out, so the client's
next turn finds it at once."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from tokenyard.api.context import read_request
from tokenyard.api.respond import Plan, answer
from tokenyard.api.responses import background, conversations, mcp, stored
from tokenyard.api.responses.convert import (
    first_user_text,
    fitted_conversation,
    item_messages,
    items_json,
    parse_items,
    request_items,
    request_params,
    response_shell,
    tool_use,
)
from tokenyard.api.responses.mcp import McpPart
from tokenyard.api.responses.schemas import ResponsesRequest
from tokenyard.api.responses.stream import ResponsesFormat
from tokenyard.errors import invalid_request
from tokenyard.gateway.call import Prepared
from tokenyard.gateway.pipeline import Run, Served, placed, preparer, text_size
from tokenyard.telemetry.timeline import Timeline

logger = logging.getLogger("tokenyard.api")


async def create_response(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    req = await read_request(request, ResponsesRequest)
    earlier = []
    if req.previous_response_id is not None:
        if req.conversation is not None:
            raise invalid_request("'conversation' and 'previous_response_id' cannot be "
                                  "used together.", param="conversation")
        earlier = await stored.expand_previous(request, req.previous_response_id)
    conversation_id = None
    if req.conversation is not None:
        conversation_id = conversations.conversation_id(req.conversation)
        earlier = await conversations.items_of(request, conversation_id)

    async def keep(response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        if conversation_id is not None:
            await conversations.append(request, conversation_id,
                                       [*items, *(response.get("output") or [])])
        if req.store is not False:
            await stored.remember(request, response, items)

    if mcp.offered(req):  # the platform runs the MCP tools between the model's turns
        return await mcp.answer_mcp(request, req, earlier, keep, response_plan)
    plan = response_plan(req, earlier, keep)
    if req.background:  # queued now, run by a background worker (background.py)
        return await background.create(request, req, plan, earlier)
    return await answer(request, plan)


#: Stores a finished response with its turn's input items (`stored.remember`).
Keep = Callable[[dict[str, Any], list[dict[str, Any]]], Awaitable[None]]


def response_plan(req: ResponsesRequest, earlier_items: list[dict[str, Any]],
                  keep: Keep, mcp_part: McpPart | None = None) -> Plan:
    """A Responses request's `Plan`, after the turns it continues (`earlier_items`, as
    `stored.expand_previous` gives them); `keep` stores the response (unless `store` is
    false) before its last bytes go out. `mcp_part`: its MCP tools, run by the platform
    (`api/responses/mcp.py`)."""
    items = request_items(req)
    earlier = parse_items(earlier_items)
    conversation = [*earlier, *(items if mcp_part is None else mcp_part.items)]
    truncate = req.truncation == "auto"

    def build(served: Served, timeline: Timeline) -> Prepared:
        tools, passed_on, native = placed(
            tool_use(req, mcp_part.tools if mcp_part is not None else ()), served)
        prepare, _ = preparer(served)
        # Images weigh nothing in the prompt's token count: loaded once it is fitted.
        messages, prompt, params = fitted_conversation(
            prepare, conversation, prepare.constrained(request_params(req, served.sampling), tools),
            instructions=req.instructions, use=tools, native=native, truncate=truncate,
            first_index=-len(earlier),
            param="max_output_tokens" if req.max_output_tokens is not None else "input",
            timeline=timeline)
        return Prepared([prompt], [params], messages=messages, passed_on=passed_on,
                        tools=tools or passed_on)

    plain = item_messages(conversation, req.instructions, None, False, -len(earlier))

    def fmt(run: Run) -> ResponsesFormat:
        shell = response_shell(req, run.served.name, run.served.sampling)
        if mcp_part is not None:
            return mcp_part.format(shell, run)
        return ResponsesFormat(shell, run.ready.tools, run.token_bytes,
                               run.served.reasoning_for(run.ready.prompts[0]))

    async def remember(fmt: ResponsesFormat) -> None:
        if fmt.final is None:  # failed: nothing a later turn could continue from
            return
        try:
            await keep(fmt.final, items_json(items))
        except Exception:  # the reply went out whole; only its continuation is lost
            logger.exception("storing response %s failed", fmt.final["id"])

    return Plan(req.model, build, fmt, bool(req.stream), dict(
        text_size=text_size(plain), param="input", bounded=not truncate,
        first_user_text=first_user_text(conversation), fallbacks=req.fallbacks(req.model)),
        finish=remember if req.store is not False or req.conversation is not None else None)


def add_responses_routes(app: web.Application) -> None:
    """The Responses dialect's POST route on `app` (GET, DELETE and cancel of a response
    are `background_run.py`'s, input_items `stored.py`'s, compact `compact.py`'s)."""
    app.router.add_post("/v1/responses", create_response)
    conversations.add_conversation_routes(app)
