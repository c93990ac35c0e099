"""The Responses API's `mcp` tools, run by the platform (`api/mcp_answer.py`,
`gateway/mcp_loop.py`).

A request's `mcp` tools name their servers (`server_url`, or the `server_label` of a
server an admin registered), the tools they may offer (`allowed_tools`) and which calls
wait for the client's approval (`require_approval`; absent: every call, as OpenAI's
default). A server whose `mcp_list_tools` item is already in the conversation is not
listed again. The client approves a waiting call with an `mcp_approval_response` input
item: the call runs before the model's first turn, and its mcp_call item leads the new
response's output; a refused call is not run (the model reads that it was not approved).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tokenyard.api.mcp_answer import answer_with_tools
from tokenyard.api.respond import Plan
from tokenyard.api.responses.convert import first_user_text, parse_items, request_items
from tokenyard.api.responses.mcp_schemas import (
    ApprovalFilter,
    McpApprovalRequestItem,
    McpApprovalResponseItem,
    McpCallItem,
    McpListToolsItem,
    McpTool,
    ToolFilter,
)
from tokenyard.api.responses.mcp_stream import McpResponsesFormat, finish_call
from tokenyard.api.responses.objects import McpCallOutput, ResponseObject
from tokenyard.api.responses.schemas import FunctionTool, InputItem, ResponsesRequest
from tokenyard.errors import invalid_request
from tokenyard.gateway.mcp_loop import LoopRun
from tokenyard.gateway.mcp_registry import RequestedServer
from tokenyard.gateway.mcp_toolbox import Toolbox
from tokenyard.gateway.mcp_tools import Approval, ListedTool
from tokenyard.gateway.pipeline import Run
from tokenyard.text.tools import Tool

#: What the model reads of a call the client did not approve.
NOT_APPROVED = "The user did not approve this call."


@dataclass
class McpPart:
    """What `response_plan` takes of a request's MCP tools: the turn's items as the
    prompt renders them (approved calls run), the servers' tools, the calls run before
    the first turn, and the open servers."""

    items: list[InputItem]
    tools: tuple[Tool, ...]
    toolbox: Toolbox
    before: list[McpCallOutput]

    def format(self, shell: ResponseObject, run: Run) -> McpResponsesFormat:
        assert isinstance(run, LoopRun)
        return McpResponsesFormat(shell, run.ready.tools, run, self.toolbox, self.before)


def offered(req: ResponsesRequest) -> bool:
    """Whether the request's tools include an MCP server."""
    return any(isinstance(t, McpTool) for t in req.tools or ())


def _names(value: ToolFilter | None) -> frozenset[str]:
    return frozenset(value.tool_names or ()) if value is not None else frozenset()


def _approval(rule: str | ApprovalFilter | None) -> Approval:
    if rule is None or rule == "always":
        return Approval("always")
    if rule == "never":
        return Approval("never")
    assert isinstance(rule, ApprovalFilter)
    return Approval("always", _names(rule.always), _names(rule.never))


def requested(req: ResponsesRequest) -> list[RequestedServer]:
    """The request's MCP tools as the registry resolves them."""
    out = []
    for i, tool in enumerate(req.tools or ()):
        if not isinstance(tool, McpTool):
            continue
        headers = dict(tool.headers or {})
        if tool.authorization is not None:
            headers["Authorization"] = f"Bearer {tool.authorization}"
        allowed = tool.allowed_tools
        names = (frozenset(allowed) if isinstance(allowed, list)
                 else frozenset(allowed.tool_names) if allowed is not None
                 and allowed.tool_names is not None else None)
        read_only = isinstance(allowed, ToolFilter) and allowed.read_only is True
        out.append(RequestedServer(tool.server_label, tool.server_url, f"tools.{i}", headers,
                                   names, _approval(tool.require_approval), read_only))
    return out


def known_lists(items: Sequence[InputItem]) -> dict[str, list[ListedTool]]:
    """The servers an earlier turn listed (the last listing of each), by label."""
    known: dict[str, list[ListedTool]] = {}
    for item in items:
        if isinstance(item, McpListToolsItem) and item.error is None:
            known[item.server_label] = [ListedTool(
                str(t.get("name")), t.get("description"), dict(t.get("input_schema") or {}),
                bool((t.get("annotations") or {}).get("readOnlyHint")), t.get("annotations"))
                for t in item.tools if isinstance(t, dict) and t.get("name")]
    return known


async def approved(earlier: Sequence[InputItem], items: Sequence[InputItem],
                   toolbox: Toolbox) -> tuple[list[InputItem], list[McpCallOutput]]:
    """This turn's items with each approval answered: an approved call run (its mcp_call
    item, also the response's first outputs), a refused one told to the model."""
    asked = {i.id: i for i in [*earlier, *items] if isinstance(i, McpApprovalRequestItem)}
    done = {i.approval_request_id for i in earlier if isinstance(i, McpCallItem)}
    out: list[InputItem] = []
    before: list[McpCallOutput] = []
    for position, item in enumerate(items):
        if not isinstance(item, McpApprovalResponseItem):
            out.append(item)
            continue
        request = asked.get(item.approval_request_id)
        if request is None:
            raise invalid_request(f"No MCP approval request '{item.approval_request_id}' "
                                  "in this conversation.",
                                  param=f"input.{position}.approval_request_id")
        if item.approval_request_id in done:
            continue
        call = McpCallOutput(server_label=request.server_label, name=request.name,
                             arguments=request.arguments, approval_request_id=request.id)
        if item.approve and toolbox.server_of(request.name) is not None:
            before.append(finish_call(call, await toolbox.call(request.name,
                                                               request.arguments)))
        else:
            call.error, call.output = {"type": "mcp_tool_execution_error", "content": [
                {"type": "text", "text": NOT_APPROVED}]}, NOT_APPROVED
        out.append(McpCallItem.model_validate(call.model_dump(mode="json"), strict=False))
    return out, before


async def answer_mcp(
    request: web.Request, req: ResponsesRequest, earlier_items: list[dict[str, Any]],
    keep: Any, plan_of: Callable[..., Plan],
) -> web.StreamResponse:
    """Answer a Responses request that offers MCP tools (`plan_of`: `response_plan`)."""
    earlier = parse_items(earlier_items)
    items = request_items(req)

    async def make_plan(toolbox: Toolbox) -> Plan:
        prompt_items, before = await approved(earlier, items, toolbox)
        return plan_of(req, earlier_items, keep, McpPart(prompt_items, toolbox.tools,
                                                         toolbox, before))

    functions = [t.name for t in req.tools or () if isinstance(t, FunctionTool)]
    return await answer_with_tools(
        request, req.model, requested(req), make_plan, known=known_lists([*earlier, *items]),
        taken=functions, max_calls=req.max_tool_calls, output_cap=req.max_output_tokens,
        first_user_text=first_user_text([*earlier, *items]))
