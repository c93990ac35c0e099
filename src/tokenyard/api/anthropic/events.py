"""The events of a streamed /v1/messages response, in Anthropic's shapes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tokenyard.api.anthropic.schemas import (
    AnthropicMessage,
    OutputTokensDetails,
    ResponseBlock,
    StopReason,
    TextBlock,
)


class MessageStartEvent(BaseModel):
    """First event of a stream: the message with empty content."""

    type: Literal["message_start"] = "message_start"
    message: AnthropicMessage


class ContentBlockStartEvent(BaseModel):
    """Opens content block `index`."""

    type: Literal["content_block_start"] = "content_block_start"
    index: int = 0
    content_block: ResponseBlock = Field(default_factory=lambda: TextBlock(text=""))


class PingEvent(BaseModel):
    """Keep-alive; the SDK skips it."""

    type: Literal["ping"] = "ping"


class TextDelta(BaseModel):
    """New text of a text block."""

    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJSONDelta(BaseModel):
    """The next fragment of a tool_use block's input (JSON text)."""

    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDelta(BaseModel):
    """New text of a thinking block."""

    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class ContentBlockDeltaEvent(BaseModel):
    """A delta of content block `index`."""

    type: Literal["content_block_delta"] = "content_block_delta"
    index: int = 0
    delta: TextDelta | InputJSONDelta | ThinkingDelta


class ContentBlockStopEvent(BaseModel):
    """Closes content block `index`."""

    type: Literal["content_block_stop"] = "content_block_stop"
    index: int = 0


class MessageDelta(BaseModel):
    """Top-level changes of the message: why it stopped."""

    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    #: Required by the spec, null here: no refusal details, no code-execution container.
    stop_details: None = None
    container: None = None


class MessageDeltaUsage(BaseModel):
    """Cumulative usage sent with message_delta."""

    input_tokens: int | None = None
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    server_tool_use: None = None
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class MessageDeltaEvent(BaseModel):
    """Stop reason and final usage."""

    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(BaseModel):
    """Last event of a successful stream."""

    type: Literal["message_stop"] = "message_stop"


class ErrorDetail(BaseModel):
    """`error` of an error body or event."""

    type: str
    message: str


class ErrorEvent(BaseModel):
    """An error after the stream began (HTTP status is already 200)."""

    type: Literal["error"] = "error"
    error: ErrorDetail


StreamEvent = (
    MessageStartEvent
    | ContentBlockStartEvent
    | PingEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
    | ErrorEvent
)
