"""The Anthropic dialect's stream: the events of one streamed /v1/messages response,
and its `Format` for the one response writer (`api/respond.py`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tokenyard.api.anthropic.convert import (
    anthropic_stop_reason,
    anthropic_usage,
    build_anthropic_message,
    new_message_id,
)
from tokenyard.api.anthropic.events import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJSONDelta,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessageStartEvent,
    MessageStopEvent,
    PingEvent,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
)
from tokenyard.api.anthropic.schemas import (
    AnthropicMessage,
    AnthropicUsage,
    OutputTokensDetails,
    ResponseBlock,
    ThinkingBlock,
)
from tokenyard.api.anthropic.tool_schemas import ToolUseBlock
from tokenyard.api.anthropic.tools import parser as tool_parser
from tokenyard.api.sse import anthropic_stream_error, sse_event
from tokenyard.errors import APIError
from tokenyard.gateway.call import Generated
from tokenyard.text.reasoning import ReasoningStream
from tokenyard.text.tool_calls import (
    CallArguments,
    CallStart,
    MarkupFilter,
    TextPiece,
    ToolCallParser,
    ToolEvent,
)
from tokenyard.text.tools import ToolUse
from tokenyard.wire.outputs import Completion, CompletionDelta, RequestOutput
from tokenyard.wire.protocol import Pin, cache_writes


@dataclass
class AnthropicStream:
    """Builds the events of one streamed /v1/messages response.

    `start_events` → message_start, content_block_start, ping; `delta_events` for each engine
    delta → content_block_delta (text_delta), and on the finishing delta content_block_stop,
    message_delta (stop reason, cumulative usage) and message_stop. Send each event with
    `sse.anthropic_event`, whose SSE event name is the payload's `type`.
    """

    id: str
    model: str
    stop_sequences: Sequence[str] = ()
    #: The request's prompt-cache pins (cache_control breakpoints), for its cache writes.
    pins: Sequence[Pin] = ()
    #: The request's tools: calls are parsed out of the text and sent as tool_use blocks
    #: (the text block then opens only when text comes).
    tools: ToolUse | None = None
    #: The deployment's reasoning parser and whether the prompt opened the block: the
    #: thinking streams as a thinking block first (`Served.reasoning_for`).
    reasoning: tuple[str, bool] | None = None
    token_bytes: Callable[[int], bytes] | None = None
    _block_open: bool = False
    _thinking_open: bool = False  # the open block is the thinking block
    _thinking: ReasoningStream | None = None
    _index: int = 0  # the open (or last) block's index
    _blocks: int = 0  # blocks opened so far
    _parser: ToolCallParser | None = None
    _plain: MarkupFilter | None = None  # without tools: the text, markup parsed out

    def __post_init__(self) -> None:
        self._parser = tool_parser(self.tools)
        if self._parser is None:
            self._plain = MarkupFilter(self.tools)
        if self.reasoning is not None:
            self._thinking = ReasoningStream(self.token_bytes or (lambda _: b""),
                                             *self.reasoning)

    def _usage(self, prompt_tokens: int, output_tokens: int, cached_tokens: int
               ) -> AnthropicUsage:
        writes = cache_writes(self.pins, cached_tokens) if self.pins else None
        return anthropic_usage(prompt_tokens, output_tokens, cached_tokens, writes)

    def message_start(self, prompt_tokens: int, cached_tokens: int = 0) -> MessageStartEvent:
        """message_start: the message with no content yet and the input usage."""
        return MessageStartEvent(message=AnthropicMessage(
            id=self.id, model=self.model, content=[],
            usage=self._usage(prompt_tokens, 0, cached_tokens),
        ))

    def content_block_start(self, block: ResponseBlock | None = None) -> ContentBlockStartEvent:
        """Opens the next block: a text block, or `block`."""
        self._block_open, self._index = True, self._blocks
        self._blocks += 1
        if block is None:
            return ContentBlockStartEvent(index=self._index)
        return ContentBlockStartEvent(index=self._index, content_block=block)

    def content_block_stop(self) -> list[StreamEvent]:
        """content_block_stop of the open block (none when no block is open)."""
        if not self._block_open:
            return []
        self._block_open = self._thinking_open = False
        return [ContentBlockStopEvent(index=self._index)]

    def start_events(self, prompt_tokens: int, cached_tokens: int = 0) -> list[StreamEvent]:
        """message_start, content_block_start (not yet with tools), ping."""
        later = self._parser is not None or self._thinking is not None
        opening = [] if later else [self.content_block_start()]
        return [self.message_start(prompt_tokens, cached_tokens), *opening, PingEvent()]

    def text_delta(self, text: str) -> ContentBlockDeltaEvent:
        """content_block_delta with a text_delta."""
        return ContentBlockDeltaEvent(index=self._index, delta=TextDelta(text=text))

    def _text_events(self, text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if not self._block_open:
            events.append(self.content_block_start())
        events.append(self.text_delta(text))
        return events

    def _thinking_events(self, thought: str) -> list[StreamEvent]:
        """The thinking block's next text (opening it first)."""
        if not thought:
            return []
        events: list[StreamEvent] = []
        if not self._thinking_open:
            events.append(self.content_block_start(ThinkingBlock(thinking="")))
            self._thinking_open = True
        events.append(ContentBlockDeltaEvent(index=self._index,
                                             delta=ThinkingDelta(thinking=thought)))
        return events

    def _tool_events(self, events: Sequence[ToolEvent]) -> list[StreamEvent]:
        """Text pieces into the text block, each call into a tool_use block of its own."""
        out: list[StreamEvent] = []
        text_open = False
        for event in events:
            if isinstance(event, TextPiece):
                if self._block_open and not text_open:
                    out.extend(self.content_block_stop())
                out.extend(self._text_events(event.text))
                text_open = True
            elif isinstance(event, CallStart):
                out.extend(self.content_block_stop())
                out.append(self.content_block_start(self.call_block(event)))
                text_open = False
            elif isinstance(event, CallArguments):
                out.append(ContentBlockDeltaEvent(
                    index=self._index, delta=InputJSONDelta(partial_json=event.fragment)))
        return out

    def call_block(self, call: CallStart) -> ResponseBlock:
        """The block a call opens (`api/anthropic/mcp.py`: an MCP tool's)."""
        return ToolUseBlock(id=call.id, name=call.name, input={})

    def finish_events(
        self,
        finish_reason: str | None,
        stop_reason: int | str | None,
        prompt_tokens: int,
        output_tokens: int,
        cached_tokens: int = 0,
    ) -> list[StreamEvent]:
        """content_block_stop (if a block is open), message_delta, message_stop."""
        reason, sequence = anthropic_stop_reason(
            finish_reason or "stop", stop_reason, self.stop_sequences
        )
        if reason == "end_turn" and self._parser is not None and self._parser.made_calls:
            reason = "tool_use"
        usage = self._usage(prompt_tokens, output_tokens, cached_tokens)
        events: list[StreamEvent] = self.content_block_stop()
        events.append(MessageDeltaEvent(
            delta=MessageDelta(stop_reason=reason, stop_sequence=sequence),
            usage=MessageDeltaUsage(
                input_tokens=usage.input_tokens,
                output_tokens=output_tokens,
                cache_creation_input_tokens=usage.cache_creation_input_tokens,
                cache_read_input_tokens=usage.cache_read_input_tokens,
                output_tokens_details=OutputTokensDetails(
                    thinking_tokens=0 if self._thinking is None else self._thinking.tokens),
            ),
        ))
        events.append(MessageStopEvent())
        return events

    def delta_events(
        self,
        delta: CompletionDelta,
        prompt_tokens: int,
        output_tokens: int,
        cached_tokens: int = 0,
    ) -> list[StreamEvent]:
        """Events for one engine delta; the usage figures are the request's running totals."""
        events: list[StreamEvent] = []
        text = delta.text
        if self._thinking is not None:
            split = self._thinking.push(text, delta.token_ids, delta.finish_reason is not None)
            events.extend(self._thinking_events(split.reasoning))
            text = split.content
            if text and self._thinking_open:
                events.extend(self.content_block_stop())
        if self._parser is not None:
            pieces = self._parser.feed(text)
            if delta.finish_reason is not None:
                pieces += self._parser.finish()
            events.extend(self._tool_events(pieces))
        elif self._plain is not None and (text := self._plain.feed(
                text, delta.finish_reason is not None)):
            events.extend(self._text_events(text))
        if delta.finish_reason is not None:
            events.extend(self.finish_events(
                delta.finish_reason, delta.stop_reason, prompt_tokens, output_tokens,
                cached_tokens,
            ))
        return events

    def output_events(self, output: RequestOutput) -> list[StreamEvent]:
        """Events for one engine step's output (n is 1 on this API)."""
        return [
            event
            for d in output.deltas
            for event in self.delta_events(
                d, output.num_prompt_tokens, output.num_output_tokens, output.num_cached_tokens
            )
        ]


class MessagesFormat:
    """A /v1/messages response (n is 1 on this API) for `api.respond.generate`."""

    terminator = b""

    def __init__(self, model: str, stop_sequences: Sequence[str], request_id: str,
                 pins: Sequence[Pin] = (), tools: ToolUse | None = None,
                 reasoning: tuple[str, bool] | None = None,
                 token_bytes: Callable[[int], bytes] | None = None) -> None:
        self.stream = AnthropicStream(new_message_id(), model, stop_sequences, pins, tools,
                                      reasoning, token_bytes)
        self.request_id = request_id
        self._started = False

    def body(
        self, gens: Sequence[Generated], completions: Sequence[list[Completion]]
    ) -> BaseModel:
        gen, stream = gens[0], self.stream
        return build_anthropic_message(
            id=stream.id, model=stream.model, completion=completions[0][0],
            prompt_tokens=gen.num_prompt_tokens, cached_tokens=gen.num_cached_tokens,
            stop_sequences=stream.stop_sequences,
            output_tokens=gen.last.num_output_tokens if gen.last is not None else None,
            cache_writes=gen.cache_writes if stream.pins else None,
            tools=stream.tools, reasoning=stream.reasoning, token_bytes=stream.token_bytes,
        )

    def head(self) -> list[BaseModel]:
        return []

    def events(self, index: int, out: RequestOutput) -> list[BaseModel]:
        events: list[BaseModel] = []
        if not self._started:
            # The first output is in: the cached-token count is known for message_start.
            self._started = True
            events.extend(self.stream.start_events(out.num_prompt_tokens,
                                                   out.num_cached_tokens))
        events.extend(self.stream.output_events(out))
        return events

    def tail(self, gens: Sequence[Generated]) -> list[BaseModel]:
        return []

    def encode(self, event: Any) -> bytes:
        """Named after the payload's `type`, as Anthropic's events are."""
        name = event["type"] if isinstance(event, dict) else event.type
        return sse_event(name, event)

    def error(self, err: APIError) -> bytes:
        return anthropic_stream_error(err, self.request_id)
