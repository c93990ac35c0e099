"""The Responses dialect's `Format` for the one response writer (`api/respond.py`): the
non-streamed response object, or its semantic events in OpenAI's order.

A stream opens with response.created and response.in_progress. Text opens a message item
(output_item.added, content_part.added) and goes out as output_text.delta events; with
tools, each call the parser reads out of the text opens a function_call item
(output_item.added) whose arguments go out as function_call_arguments.delta events. An
item closes (output_text.done, content_part.done or function_call_arguments.done, then
output_item.done) when the next one opens or the reply ends; response.completed (or
response.incomplete) carries the whole response with its usage. A failure after the 200
is response.failed. Every event has the stream's next `sequence_number`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from tokenyard.api.openai.convert import TokenBytes, chat_logprobs, no_bytes
from tokenyard.api.openai.schemas import TokenLogprob
from tokenyard.api.openai.tools import parser as tool_parser
from tokenyard.api.responses.convert import INCOMPLETE_REASONS, finished, output_items
from tokenyard.api.responses.objects import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    Event,
    FunctionCallOutput,
    ItemEvent,
    OutputItem,
    OutputMessage,
    OutputText,
    PartEvent,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningOutput,
    ReasoningText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    TextDeltaEvent,
    TextDoneEvent,
    response_usage,
)
from tokenyard.api.sse import sse_event
from tokenyard.errors import APIError
from tokenyard.gateway.call import Generated
from tokenyard.text.reasoning import ReasoningStream, split_completion
from tokenyard.text.tool_calls import CallArguments, CallStart, MarkupFilter, TextPiece, ToolEvent
from tokenyard.text.tools import ToolUse
from tokenyard.wire.outputs import Completion, CompletionDelta, Logprob, RequestOutput

#: `error.code` of a failed response, by the status of the error that ended it (the SDK
#: knows a closed set of codes).
_FAILED_CODES = {429: "rate_limit_exceeded", 400: "invalid_prompt"}


class ResponsesFormat:
    """One response of POST /v1/responses (one prompt, one choice). `final` holds the
    finished response's JSON (completed or incomplete), for storage, once it is built."""

    terminator = b""

    def __init__(self, response: ResponseObject, tools: ToolUse | None,
                 token_bytes: TokenBytes | None = None,
                 reasoning: tuple[str, bool] | None = None) -> None:
        self.response = response
        self.tools = tools
        self.final: dict[str, Any] | None = None
        #: How logprobs spell tokens; logprobs go out only without active tools (with
        #: them, the text's pieces are not its tokens).
        self.token_bytes = token_bytes
        self._parser = tool_parser(tools)
        self._plain = MarkupFilter(tools)  # without active tools: markup parsed out
        self._logprobs: list[TokenLogprob] = []  # of tokens whose text has not gone out
        self._sequence = 0
        self._open: OutputItem | None = None
        self._finish_reason: str | None = None
        self._queued = False  # a background response: created and queued went out
        #: The deployment's reasoning parser and whether the prompt opened its block: the
        #: thinking goes to a reasoning item ahead of the message, its tokens to
        #: `reasoning_tokens` (None: a reply has no reasoning to split).
        self.reasoning = reasoning
        self._thinking = None if reasoning is None else ReasoningStream(
            token_bytes or no_bytes, *reasoning)
        self._generated = 0  # tokens streamed so far (which logprobs are the thinking's)
        self._reasoning_tokens = 0  # of the non-streamed reply

    # ------------------------------------------------------------------ non-streamed

    def body(
        self, gens: Sequence[Generated], completions: Sequence[list[Completion]]
    ) -> BaseModel:
        completion = completions[0][0]
        text, logprobs = completion.text, self._token_logprobs(completion.logprobs)
        thought: list[OutputItem] = []
        if self.reasoning is not None:
            reasoning, text, self._reasoning_tokens = split_completion(
                text, completion.token_ids, self.token_bytes or no_bytes, self.reasoning)
            logprobs = logprobs[self._reasoning_tokens:]  # the answer's tokens only
            if reasoning:
                thought.append(ReasoningOutput(content=[ReasoningText(text=reasoning)]))
        self.response.output = [*thought, *output_items(text, self.tools, logprobs)]
        return self._finished(gens, completion.finish_reason)

    def _finished(self, gens: Sequence[Generated], finish_reason: str | None
                  ) -> ResponseObject:
        gen = gens[0]
        output_tokens = gen.last.num_output_tokens if gen.last is not None else 0
        reasoning = (self._thinking.tokens if self._thinking is not None
                     and self._generated else self._reasoning_tokens)
        finished(self.response, finish_reason,
                 response_usage(gen.num_prompt_tokens, output_tokens, gen.num_cached_tokens,
                                reasoning))
        self.final = self.response.model_dump(mode="json")
        return self.response

    # ------------------------------------------------------------------ streamed

    def _event(self, cls: type[Event], kind: str, **fields: Any) -> Event:
        event = cls(type=f"response.{kind}", sequence_number=self._sequence, **fields)
        self._sequence += 1
        return event

    def _lifecycle(self, kind: str) -> Event:
        return self._event(ResponseEvent, kind, response=self.response.model_copy(deep=True))

    def head(self) -> list[BaseModel]:
        if self._queued:
            return [self._lifecycle("in_progress")]
        return [self._lifecycle("created"), self._lifecycle("in_progress")]

    def events(self, index: int, out: RequestOutput) -> list[BaseModel]:
        events: list[BaseModel] = []
        for delta in out.deltas:
            events.extend(self._delta_events(delta))
        return events

    def _token_logprobs(self, entries: list[Logprob] | None) -> list[TokenLogprob]:
        if not entries or self._parser is not None or self.token_bytes is None:
            return []
        return chat_logprobs(entries, self.token_bytes).content or []

    def _delta_events(self, delta: CompletionDelta) -> list[Event]:
        logprobs = self._token_logprobs(delta.logprobs)
        text, events = delta.text, []
        if self._thinking is not None:
            split = self._thinking.push(text, delta.token_ids, delta.finish_reason is not None)
            first = self._generated
            self._generated += len(delta.token_ids)
            thinking = self._thinking.settled  # the thinking's tokens have no logprobs here
            logprobs = [] if thinking is None else logprobs[max(0, thinking - first):]
            if split.reasoning:
                events.extend(self._reasoning_events(split.reasoning))
            text = split.content
        self._logprobs.extend(logprobs)
        pieces: list[ToolEvent]
        if self._parser is None:
            text = self._plain.feed(text, delta.finish_reason is not None)
            pieces = [TextPiece(text)] if text else []
        else:
            pieces = self._parser.feed(text)
            if delta.finish_reason is not None:
                pieces += self._parser.finish()
        events.extend(e for piece in pieces for e in self._piece_events(piece))
        if delta.finish_reason is not None:
            self._finish_reason = delta.finish_reason
            if all(isinstance(i, ReasoningOutput)  # an empty reply is one (empty) message
                   for i in self.response.output):
                events.extend(self._close("completed"))
                events.extend(self._open_item(OutputMessage()))
            incomplete = delta.finish_reason in INCOMPLETE_REASONS
            events.extend(self._close("incomplete" if incomplete else "completed"))
        return events

    def _reasoning_events(self, text: str) -> list[Event]:
        """More thinking: opens the reasoning item first when it is not open."""
        events: list[Event] = []
        if not isinstance(self._open, ReasoningOutput):
            events.extend(self._close("completed"))
            events.extend(self._open_item(ReasoningOutput()))
        item = self._open
        assert isinstance(item, ReasoningOutput)
        item.content[0].text += text
        events.append(self._event(ReasoningDeltaEvent, "reasoning.delta", item_id=item.id,
                                  output_index=self._index, delta=text))
        return events

    def _piece_events(self, piece: ToolEvent) -> list[Event]:
        events: list[Event] = []
        if isinstance(piece, TextPiece):
            if not isinstance(self._open, OutputMessage):
                events.extend(self._close("completed"))
                events.extend(self._open_item(OutputMessage()))
            message = self._message()
            logprobs, self._logprobs = self._logprobs, []
            message.content[0].text += piece.text
            message.content[0].logprobs.extend(logprobs)
            events.append(self._event(TextDeltaEvent, "output_text.delta", item_id=message.id,
                                      output_index=self._index, delta=piece.text,
                                      logprobs=logprobs))
        elif isinstance(piece, CallStart):
            events.extend(self._close("completed"))
            events.extend(self._open_item(FunctionCallOutput(call_id=piece.id,
                                                             name=piece.name)))
        elif isinstance(piece, CallArguments) and isinstance(self._open, FunctionCallOutput):
            self._open.arguments += piece.fragment
            events.append(self._event(ArgumentsDeltaEvent, "function_call_arguments.delta",
                                      item_id=self._open.id, output_index=self._index,
                                      delta=piece.fragment))
        return events

    @property
    def _index(self) -> int:
        return len(self.response.output) - 1

    def _message(self) -> OutputMessage:
        assert isinstance(self._open, OutputMessage)
        return self._open

    def _open_item(self, item: OutputItem) -> list[Event]:
        self.response.output.append(item)
        self._open = item
        events = [self._event(ItemEvent, "output_item.added", output_index=self._index,
                              item=item.model_copy(deep=True))]
        part: OutputText | ReasoningText | None = None
        if isinstance(item, OutputMessage):
            part = OutputText()
            item.content.append(part)
        elif isinstance(item, ReasoningOutput):
            part = ReasoningText()
            item.content.append(part)
        if part is not None:
            events.append(self._event(PartEvent, "content_part.added", item_id=item.id,
                                      output_index=self._index,
                                      part=part.model_copy(deep=True)))
        return events

    def _close(self, status: str) -> list[Event]:
        """The events that close the open item (none when none is open)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = "incomplete" if status == "incomplete" else "completed"
        at = {"item_id": item.id, "output_index": self._index}
        if isinstance(item, OutputMessage):
            part = item.content[0]
            part.logprobs.extend(self._logprobs)
            self._logprobs = []
            events = [self._event(TextDoneEvent, "output_text.done", text=part.text,
                                  logprobs=part.logprobs, **at),
                      self._event(PartEvent, "content_part.done",
                                  part=part.model_copy(deep=True), **at)]
        elif isinstance(item, ReasoningOutput):
            thought = item.content[0]
            events = [self._event(ReasoningDoneEvent, "reasoning.done", text=thought.text,
                                  **at),
                      self._event(PartEvent, "content_part.done",
                                  part=thought.model_copy(deep=True), **at)]
        else:  # a function call (the MCP items close in `mcp_stream`)
            assert isinstance(item, FunctionCallOutput)
            events = [self._event(ArgumentsDoneEvent, "function_call_arguments.done",
                                  arguments=item.arguments, **at)]
        events.append(self._event(ItemEvent, "output_item.done", output_index=self._index,
                                  item=item.model_copy(deep=True)))
        return events

    def tail(self, gens: Sequence[Generated]) -> list[BaseModel]:
        response = self._finished(gens, self._finish_reason)
        return [self._lifecycle(response.status)]

    def encode(self, event: Any) -> bytes:
        """Named after the payload's `type`, as OpenAI's Responses events are."""
        name = event["type"] if isinstance(event, dict) else event.type
        return sse_event(name, event)

    def error(self, err: APIError) -> bytes:
        return self.encode(self.failed(err))

    def failed(self, err: APIError) -> Event:
        """The response failed with `err`: its response.failed event."""
        self.response.status = "failed"
        self.response.error = ResponseError(
            code=_FAILED_CODES.get(err.status, "server_error"), message=err.message)
        return self._lifecycle("failed")

    def after_queue(self, queued: ResponseObject, events: int) -> None:
        """A background response, `queued` as it was when its first `events` went out
        (response.created, response.queued): this run is that response (its id and
        creation time), its stream goes on after them, and `head` is response.in_progress
        alone."""
        self.response.id = queued.id
        self.response.created_at = queued.created_at
        self.response.background = True
        self._sequence = events
        self._queued = True
