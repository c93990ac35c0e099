"""The Responses dialect's `Format` of a response whose tools include MCP servers
(`gateway/mcp_loop.py` runs the calls between the model's turns).

Beside the events of `ResponsesFormat`, in OpenAI's order: each server listed by this
response opens and closes an mcp_list_tools item (response.mcp_list_tools.in_progress,
.completed) after response.in_progress; a call the model writes to an MCP tool opens an
mcp_call item whose arguments stream as response.mcp_call_arguments.delta, then .done
and response.mcp_call.in_progress when the turn ends, and response.mcp_call.completed (or
.failed) with output_item.done once the platform ran it; a call that waits for approval
is an mcp_approval_request item instead, and the response ends after that turn. A
non-streamed body is the same events replayed (`LoopRun.record`), their final response.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from tokenyard.api.openai.tools import parser as tool_parser
from tokenyard.api.responses.objects import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    Event,
    ItemEvent,
    ItemStatusEvent,
    McpApprovalRequestOutput,
    McpCallOutput,
    McpListToolsOutput,
    OutputItem,
    ResponseObject,
)
from tokenyard.api.responses.stream import ResponsesFormat
from tokenyard.gateway.call import Generated
from tokenyard.gateway.mcp_loop import CallDone, HopEnd, LoopRun
from tokenyard.gateway.mcp_toolbox import Listing, Toolbox
from tokenyard.gateway.mcp_tools import ToolOutcome
from tokenyard.text.tool_calls import CallArguments, CallStart, ToolEvent
from tokenyard.text.tools import ToolUse
from tokenyard.wire.outputs import Completion

#: MCP's JSON-RPC code of an internal error: a call that could not run.
INTERNAL_ERROR = -32603


def listing_item(listing: Listing) -> McpListToolsOutput:
    """A server's listing as its mcp_list_tools item."""
    return McpListToolsOutput(server_label=listing.server.label, tools=[
        {"name": t.name, "description": t.description, "input_schema": t.input_schema,
         "annotations": t.annotations} for t in listing.tools])


def finish_call(item: McpCallOutput, outcome: ToolOutcome) -> McpCallOutput:
    """`item` once its call ran: its output, and an error object when it failed (the
    tool's own error, or a call that could not run)."""
    item.output = outcome.text
    if outcome.failure is not None:
        item.error = {"type": "mcp_protocol_error", "code": INTERNAL_ERROR,
                      "message": outcome.text}
    elif outcome.is_error:
        item.error = {"type": "mcp_tool_execution_error",
                      "content": [{"type": "text", "text": outcome.text}]}
    item.status = "failed" if item.error is not None else "completed"
    return item


class McpResponsesFormat(ResponsesFormat):
    """A response of an MCP loop (`LoopRun`); `before`: calls the client approved, run
    before the first turn (their items lead the output)."""

    def __init__(self, response: ResponseObject, tools: ToolUse | None, run: LoopRun,
                 toolbox: Toolbox, before: Sequence[McpCallOutput] = ()) -> None:
        super().__init__(response, tools, None)
        self.run, self.toolbox, self.before = run, toolbox, list(before)
        self._pending: list[tuple[McpCallOutput, int]] = []  # awaiting their CallDone

    # ------------------------------------------------------------------ non-streamed

    def body(self, gens: Sequence[Generated], completions: Sequence[list[Completion]]
             ) -> BaseModel:
        if self.final is None:
            self.head()
            for i, out in self.run.record:
                self.events(i, out)
            self._unrun()
            self._finished(gens, self._finish_reason)
        return self.response

    # ------------------------------------------------------------------ streamed

    def head(self) -> list[BaseModel]:
        events = super().head()
        for listing in self.toolbox.listings:
            if listing.fresh:
                events.extend(self._whole(listing_item(listing), "mcp_list_tools"))
        for item in self.before:
            events.extend(self._whole(item, None))
        return events

    def _whole(self, item: OutputItem, progress: str | None) -> list[Event]:
        """An item added and done at once (`progress`: its in_progress/completed events)."""
        self.response.output.append(item)
        at = {"item_id": item.id, "output_index": self._index}
        events = [self._event(ItemEvent, "output_item.added", output_index=self._index,
                              item=item.model_copy(deep=True))]
        if progress is not None:
            events += [self._event(ItemStatusEvent, f"{progress}.in_progress", **at),
                       self._event(ItemStatusEvent, f"{progress}.completed", **at)]
        events.append(self._event(ItemEvent, "output_item.done", output_index=self._index,
                                  item=item.model_copy(deep=True)))
        return events

    def events(self, index: int, out: Any) -> list[BaseModel]:
        if isinstance(out, HopEnd):
            pieces = self._parser.finish() if self._parser is not None else []
            events = [e for piece in pieces for e in self._piece_events(piece)]
            events.extend(self._close("completed"))
            self._parser = tool_parser(self.tools)  # the next turn's calls
            return list(events)
        if isinstance(out, CallDone):
            item, at = self._pending.pop(0)
            finish_call(item, out.outcome)
            where = {"item_id": item.id, "output_index": at}
            return [self._event(ItemStatusEvent, f"mcp_call.{item.status}", **where),
                    self._event(ItemEvent, "output_item.done", output_index=at,
                                item=item.model_copy(deep=True))]
        return super().events(index, out)

    def _piece_events(self, piece: ToolEvent) -> list[Event]:
        opened = self._open
        if isinstance(piece, CallStart) and self.toolbox.server_of(piece.name) is not None:
            server = self.toolbox.server_of(piece.name)
            assert server is not None
            events = self._close("completed")
            item: OutputItem = (
                McpApprovalRequestOutput(server_label=server.label, name=piece.name)
                if self.toolbox.needs_approval(piece.name)
                else McpCallOutput(server_label=server.label, name=piece.name))
            return events + self._open_item(item)
        if isinstance(piece, CallArguments) and isinstance(
                opened, McpCallOutput | McpApprovalRequestOutput):
            opened.arguments += piece.fragment
            if isinstance(opened, McpApprovalRequestOutput):
                return []
            return [self._event(ArgumentsDeltaEvent, "mcp_call_arguments.delta",
                                item_id=opened.id, output_index=self._index,
                                delta=piece.fragment)]
        return super()._piece_events(piece)

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if isinstance(item, McpCallOutput):
            self._open = None
            at = {"item_id": item.id, "output_index": self._index}
            self._pending.append((item, self._index))
            return [self._event(ArgumentsDoneEvent, "mcp_call_arguments.done",
                                arguments=item.arguments, **at),
                    self._event(ItemStatusEvent, "mcp_call.in_progress", **at)]
        if isinstance(item, McpApprovalRequestOutput):
            self._open = None
            item.status = "completed"
            return [self._event(ItemEvent, "output_item.done", output_index=self._index,
                                item=item.model_copy(deep=True))]
        return super()._close(status)

    def _unrun(self) -> list[Event]:
        """Close the calls the loop did not run (its limits were reached first)."""
        events: list[Event] = []
        for item, at in self._pending:
            item.status = "incomplete"
            events.append(self._event(ItemEvent, "output_item.done", output_index=at,
                                      item=item.model_copy(deep=True)))
        self._pending = []
        return events

    def tail(self, gens: Sequence[Generated]) -> list[BaseModel]:
        return [*self._unrun(), *super().tail(gens)]
