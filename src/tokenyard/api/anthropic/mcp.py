"""Anthropic's `mcp_servers` (the MCP connector), run by the platform (`api/mcp_answer.py`,
`gateway/mcp_loop.py`): each enabled server's tools (within its `allowed_tools`) are
offered to the model; a call of one becomes an `mcp_tool_use` block, the platform runs
it, and its `mcp_tool_result` block follows; the model's next turn continues the same
message, until it answers. Streamed, each block opens with content_block_start (an
mcp_tool_use's input then streams as input_json_delta) and closes with
content_block_stop; message_delta and message_stop come once, after the last turn, with
the turns' summed usage, each turn's in `usage.iterations`, in the beta API's shape
(`client.beta.messages`). Calls never wait for approval here (Anthropic's connector has
none). A non-streamed body is the same events replayed and assembled.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from tokenyard.api.anthropic.events import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJSONDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessageStartEvent,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
)
from tokenyard.api.anthropic.schemas import (
    AnthropicMessage,
    AnthropicUsage,
    MessagesRequest,
    ResponseBlock,
)
from tokenyard.api.anthropic.stream import AnthropicStream, MessagesFormat
from tokenyard.api.anthropic.tool_schemas import McpToolResultBlock, McpToolUseBlock
from tokenyard.api.anthropic.tools import parser as tool_parser
from tokenyard.api.mcp_answer import answer_with_tools
from tokenyard.api.respond import Plan
from tokenyard.errors import invalid_request
from tokenyard.gateway.call import Generated
from tokenyard.gateway.mcp_loop import CallDone, HopEnd, LoopRun
from tokenyard.gateway.mcp_registry import RequestedServer
from tokenyard.gateway.mcp_toolbox import Toolbox
from tokenyard.gateway.mcp_tools import NEVER
from tokenyard.gateway.pipeline import Run
from tokenyard.text.tool_calls import CallStart
from tokenyard.text.tools import Tool
from tokenyard.wire.outputs import Completion


@dataclass
class McpAnthropicStream(AnthropicStream):
    """The stream's blocks, an MCP tool's calls as mcp_tool_use blocks."""

    toolbox: Toolbox | None = None
    #: mcp_tool_use ids whose results are still to come, in order.
    pending: list[str] = field(default_factory=list)

    def call_block(self, call: CallStart) -> ResponseBlock:
        server = self.toolbox.server_of(call.name) if self.toolbox is not None else None
        if server is None:
            return super().call_block(call)
        self.pending.append(call.id)
        return McpToolUseBlock(id=call.id, name=call.name, server_name=server.label, input={})

    def turn_end(self) -> list[StreamEvent]:
        """A turn that ended in MCP calls: its last pieces, its open block closed."""
        pieces = self._parser.finish() if self._parser is not None else []
        events = [*self._tool_events(pieces), *self.content_block_stop()]
        self._parser = tool_parser(self.tools)
        return events


class BetaUsage(AnthropicUsage):
    """The beta API's usage: `iterations` holds each model turn's own figures."""

    fallback_credit: None = None
    iterations: list[dict[str, Any]] | None = None
    speed: None = None


class BetaMessage(AnthropicMessage):
    """The beta API's message (what `client.beta.messages` reads)."""

    usage: BetaUsage
    diagnostics: None = None
    context_management: None = None


class BetaMessageStartEvent(MessageStartEvent):
    message: BetaMessage


class BetaDeltaUsage(MessageDeltaUsage):
    fallback_credit: None = None
    iterations: list[dict[str, Any]] | None = None


class BetaMessageDeltaEvent(MessageDeltaEvent):
    usage: BetaDeltaUsage
    context_management: None = None


def iterations(turns: Sequence[tuple[int, int, int]], model: str) -> list[dict[str, Any]]:
    """Each model turn's usage, as the beta API's `usage.iterations` lists them."""
    return [{"type": "message", "model": model, "input_tokens": prompt - cached,
             "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
             "cache_creation": None, "output_tokens": output}
            for prompt, cached, output in turns]


def assembled(events: Sequence[BaseModel]) -> AnthropicMessage:
    """The message a stream's events build (its non-streamed body)."""
    message: AnthropicMessage | None = None
    blocks: list[Any] = []
    inputs: dict[int, str] = {}
    for event in events:
        if isinstance(event, MessageStartEvent):
            message = event.message.model_copy(deep=True)
        elif isinstance(event, ContentBlockStartEvent):
            blocks.append(event.content_block.model_copy(deep=True))
        elif isinstance(event, ContentBlockDeltaEvent):
            block, delta = blocks[event.index], event.delta
            if isinstance(delta, TextDelta):
                block.text += delta.text
            elif isinstance(delta, ThinkingDelta):
                block.thinking += delta.thinking
            elif isinstance(delta, InputJSONDelta):
                inputs[event.index] = inputs.get(event.index, "") + delta.partial_json
        elif isinstance(event, ContentBlockStopEvent) and event.index in inputs:
            value = json.loads(inputs.pop(event.index) or "{}")
            blocks[event.index].input = value if isinstance(value, dict) else {}
        elif isinstance(event, MessageDeltaEvent) and message is not None:
            message.stop_reason = event.delta.stop_reason
            message.stop_sequence = event.delta.stop_sequence
            usage = event.usage
            message.usage.output_tokens = usage.output_tokens
            message.usage.input_tokens = usage.input_tokens or 0
            message.usage.cache_read_input_tokens = usage.cache_read_input_tokens or 0
            message.usage.cache_creation_input_tokens = usage.cache_creation_input_tokens or 0
            if isinstance(message.usage, BetaUsage) and isinstance(usage, BetaDeltaUsage):
                message.usage.iterations = usage.iterations
    assert message is not None, "a message's events start with message_start"
    message.content = blocks
    return message


class McpMessagesFormat(MessagesFormat):
    """A /v1/messages response of an MCP loop (`LoopRun`)."""

    def __init__(self, model: str, stop_sequences: Sequence[str], request_id: str,
                 run: LoopRun, toolbox: Toolbox) -> None:
        super().__init__(model, stop_sequences, request_id, (), run.ready.tools)
        self.stream = McpAnthropicStream(self.stream.id, model, stop_sequences, (),
                                         run.ready.tools, toolbox=toolbox)
        self.run = run
        self._body: AnthropicMessage | None = None

    def body(self, gens: Sequence[Generated], completions: Sequence[list[Completion]]
             ) -> BaseModel:
        if self._body is None:
            self._body = assembled([e for i, out in self.run.record
                                    for e in self.events(i, out)])
        return self._body

    def events(self, index: int, out: Any) -> list[BaseModel]:
        stream = self.stream
        assert isinstance(stream, McpAnthropicStream)
        if isinstance(out, HopEnd):
            return list(stream.turn_end())
        if isinstance(out, CallDone):
            result = McpToolResultBlock(
                tool_use_id=stream.pending.pop(0), is_error=out.outcome.is_error,
                content=[{"type": "text", "text": out.outcome.text, "citations": None}])
            return [stream.content_block_start(result), *stream.content_block_stop()]
        return [self._beta(event) for event in super().events(index, out)]

    def _beta(self, event: BaseModel) -> BaseModel:
        """message_start and message_delta in the beta API's shape, with each turn's
        usage (`usage.iterations`)."""
        turns = iterations(self.run.turn_usage(), self.stream.model)
        if isinstance(event, MessageStartEvent):
            message = event.message
            return BetaMessageStartEvent(message=BetaMessage(
                **message.model_dump(exclude={"usage"}),
                usage=BetaUsage(**message.usage.model_dump(), iterations=turns)))
        if isinstance(event, MessageDeltaEvent):
            return BetaMessageDeltaEvent(delta=event.delta, usage=BetaDeltaUsage(
                **event.usage.model_dump(), iterations=turns))
        return event


@dataclass
class McpPart:
    """What `messages_plan` takes of a request's MCP servers: their tools, and the
    format of the loop's message."""

    tools: tuple[Tool, ...]
    toolbox: Toolbox
    req: MessagesRequest

    def format(self, run: Run) -> McpMessagesFormat:
        assert isinstance(run, LoopRun)
        return McpMessagesFormat(run.served.name, self.req.stop_sequences or [],
                                 run.call.request_id, run, self.toolbox)


def offered(req: MessagesRequest) -> bool:
    """Whether the request names an enabled MCP server."""
    return any(server.enabled for server in req.mcp_servers or ())


def requested(req: MessagesRequest) -> list[RequestedServer]:
    out = []
    for i, server in enumerate(req.mcp_servers or ()):
        if not server.enabled:
            continue
        config = server.tool_configuration
        allowed = (frozenset(config.allowed_tools) if config is not None
                   and config.allowed_tools is not None else None)
        headers = ({"Authorization": f"Bearer {server.authorization_token}"}
                   if server.authorization_token is not None else {})
        out.append(RequestedServer(server.name, server.url, f"mcp_servers.{i}", headers,
                                   allowed, NEVER))
    return out


async def answer_mcp(request: web.Request, req: MessagesRequest,
                     plan_of: Callable[..., Plan], first_user_text: str | None
                     ) -> web.StreamResponse:
    """Answer a messages request whose `mcp_servers` the platform runs (`plan_of`:
    `messages_plan`)."""

    async def make_plan(toolbox: Toolbox) -> Plan:
        choice = req.tool_choice
        names = {t.name for t in req.tools or ()} | {t.name for t in toolbox.tools}
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise invalid_request(f"tool_choice names the tool {choice.name!r}, which is "
                                  "neither among 'tools' nor an MCP server's.",
                                  param="tool_choice.name")
        return plan_of(req, McpPart(toolbox.tools, toolbox, req))

    return await answer_with_tools(
        request, req.model, requested(req), make_plan,
        taken=[t.name for t in req.tools or ()], output_cap=req.max_tokens,
        first_user_text=first_user_text)
