"""Answering a request that offers MCP tools, either dialect: the servers it names are
resolved against the org's registry (`gateway/mcp_registry.py`), connected and listed
(`Toolbox`, over `api/mcp_client.py`), the dialect makes its `Plan` with their tools,
and the loop (`gateway/mcp_loop.LoopRun`) is rendered by the one response writer.

The body kept for the request's record is the one received without the MCP secrets it
carried (`scrubbed`): the servers' headers and tokens go to the servers only.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

from tokenyard.api.context import KEY, PIPELINE, STATE, TIMELINE
from tokenyard.api.mcp_client import McpClient
from tokenyard.api.respond import Plan, generate, new_call, note
from tokenyard.gateway.mcp_loop import LoopRun, require_loop
from tokenyard.gateway.mcp_registry import RequestedServer, resolve
from tokenyard.gateway.mcp_toolbox import Toolbox
from tokenyard.gateway.mcp_tools import ListedTool, ToolClient
from tokenyard.gateway.pipeline import Call

#: The outbound client of every MCP loop: public addresses only, unless registered.
CLIENT: ToolClient = McpClient()
#: Fields whose values are secrets, wherever an MCP tool or server object holds them.
SECRET_FIELDS = frozenset({"headers", "authorization", "authorization_token"})
#: The request fields that hold MCP tools or servers.
MCP_FIELDS = ("tools", "mcp_servers")
REDACTED = "[REDACTED:mcp_secret]"

#: Makes the dialect's plan once the servers are open (`Toolbox.tools` in its tools).
MakePlan = Callable[[Toolbox], Awaitable[Plan]]


def scrubbed(raw: bytes | None) -> bytes | None:
    """`raw` (a JSON body) with every MCP secret replaced by a marker."""
    if not raw:
        return raw
    try:
        body = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(body, dict):
        return raw
    for name in MCP_FIELDS:
        for entry in body.get(name) or ():
            if isinstance(entry, dict):
                for secret in SECRET_FIELDS & entry.keys():
                    entry[secret] = REDACTED
    return json.dumps(body).encode()


async def answer_with_tools(
    request: web.Request, model: str, wanted: Sequence[RequestedServer],
    make_plan: MakePlan, *, known: Mapping[str, Sequence[ListedTool]] | None = None,
    taken: Sequence[str] = (), max_calls: int | None = None, output_cap: int | None = None,
    first_user_text: str | None = None,
) -> web.StreamResponse:
    """Answer `request` (for `model`) with the platform running its MCP tools; `known`:
    servers' tools listed by earlier turns (by label); `taken`: the request's own
    function names; `max_calls`: its cap on MCP calls; `output_cap`: its cap on each
    turn's output tokens (None: what the window leaves)."""
    pipeline = request.app[PIPELINE]
    # The model and the key's right to it first (404, 403): nothing is fetched otherwise.
    probe = Call(endpoint=request.path, request_id="", timeline=request[TIMELINE],
                 model=model, build=_never, key=request.get(KEY),
                 first_user_text=first_user_text)
    require_loop(pipeline.route(probe), "tools" if wanted[0].param.startswith("tools")
                 else "mcp_servers")
    gateway = request.app[STATE].gateway
    servers = await resolve(gateway.store if gateway is not None else None,
                            request.get(KEY), wanted)
    params = {w.label: w.param for w in wanted}
    # Admitted (RPM, concurrency, money) before any server is contacted: a key over its
    # limits or out of credit makes the platform open no outbound connection.
    held = await pipeline.admit_request(probe)
    try:
        toolbox = await Toolbox.open(CLIENT, servers, params, known or {},
                                     request[TIMELINE], taken)
    except BaseException:
        pipeline.release(held)
        raise
    try:
        plan = await make_plan(toolbox)
        call = await new_call(request, plan.model, plan.build, **plan.options)
        call.raw, call.counted = scrubbed(call.raw), probe.counted
        run = LoopRun(pipeline, call, toolbox, max_calls=max_calls, output_cap=output_cap)
        pipeline.release(held)  # its slot: hop 1 is admitted for its own prompt
        try:
            await run.start()
        finally:
            note(request, call)
    except BaseException:
        pipeline.release(held)
        await toolbox.close()
        raise
    fmt = plan.format(run)
    return await generate(request, run, fmt, stream=plan.stream, finish=plan.finisher(fmt))


def _never(*_: Any) -> Any:
    raise AssertionError("the probe call is routed, never built")
