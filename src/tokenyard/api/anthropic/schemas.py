"""Bodies of the Anthropic-compatible endpoints: /v1/messages and /v1/messages/count_tokens.

Requests: `max_tokens` is required (as Anthropic requires it), `system` is a string or a list
of text blocks, message content is a string or a list of blocks of which only `text` is
supported so far; image, document, tool_use, tool_result and thinking blocks, `tools` and
enabled `thinking` are answered with a 400 naming them. Unknown fields are ignored.

Responses and stream events mirror Anthropic's shapes so the official SDK parses them. Usage
follows Anthropic's accounting: `input_tokens` counts the prompt tokens that were *not* read
from the cache; `cache_read_input_tokens` the ones that were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from tokenyard.api.errors import schema_error
from tokenyard.api.schemas import TEXT_PART_SEPARATOR, RequestModel, reject_unknown
from tokenyard.errors import INVALID_VALUE, UNSUPPORTED_PARAMETER, UNSUPPORTED_VALUE

# ---------------------------------------------------------------------------- requests

_UNSUPPORTED_BLOCKS = frozenset(
    {
        "image",
        "document",
        "search_result",
        "tool_use",
        "tool_result",
        "server_tool_use",
        "web_search_tool_result",
        "thinking",
        "redacted_thinking",
        "container_upload",
    }
)


class TextBlockParam(RequestModel):
    """``{"type": "text", "text": ...}`` in a message or in `system`."""

    type: Literal["text"]
    text: str
    cache_control: Any = None  # accepted and ignored: prefix caching is automatic here

    @model_validator(mode="before")
    @classmethod
    def _reject_non_text(cls, data: Any) -> Any:
        if isinstance(data, dict):
            kind = data.get("type")
            if isinstance(kind, str) and kind in _UNSUPPORTED_BLOCKS:
                raise schema_error(
                    UNSUPPORTED_VALUE,
                    "type",
                    f"'{kind}' content blocks are not supported by this server yet; "
                    "send text blocks only.",
                )
        return data


def blocks_text(content: str | list[TextBlockParam]) -> str:
    """Content (a string or text blocks) as one string."""
    if isinstance(content, str):
        return content
    return TEXT_PART_SEPARATOR.join(block.text for block in content)


class MessageParam(RequestModel):
    """One message of `messages`."""

    role: Literal["user", "assistant", "system"]
    content: str | list[TextBlockParam]

    @property
    def text(self) -> str:
        """The content as one string."""
        return blocks_text(self.content)


class Metadata(RequestModel):
    """`metadata`: an opaque end-user id."""

    user_id: str | None = None


def _thinking_ok(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and value.get("type") == "disabled")


def _tool_choice_ok(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and value.get("type") in ("auto", "none"))


def _output_config_ok(value: Any) -> bool:
    return not (isinstance(value, dict) and value.get("format") is not None)


_MESSAGES_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: v is None or v == [],
    "tool_choice": _tool_choice_ok,
    "thinking": _thinking_ok,
    "output_config": _output_config_ok,
}


def _reject_unsupported(data: Any) -> None:
    if not isinstance(data, dict):
        return
    for name, ok in _MESSAGES_UNSUPPORTED.items():
        if name in data and not ok(data[name]):
            field = "output_config.format" if name == "output_config" else name
            raise schema_error(
                UNSUPPORTED_PARAMETER, field,
                f"'{field}' is not supported by this server yet.",
            )


class _Conversation(RequestModel):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        _reject_unsupported(data)
        reject_unknown(data, [*cls.model_fields, *_MESSAGES_UNSUPPORTED])
        return data

    @model_validator(mode="after")
    def _check_content(self) -> _Conversation:
        last = len(self.messages) - 1
        for i, message in enumerate(self.messages):
            empty = message.content == "" or message.content == []
            if empty and not (i == last and message.role == "assistant"):
                raise schema_error(
                    INVALID_VALUE, f"messages.{i}",
                    f"messages.{i}: every message needs non-empty content, except an optional "
                    "final assistant message.",
                )
        return self

    @property
    def system_text(self) -> str | None:
        """`system` as one string, or None when absent."""
        return None if self.system is None else blocks_text(self.system)


class MessagesRequest(_Conversation):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    stream: bool | None = None
    service_tier: str | None = None  # one tier here: accepted, without effect
    #: vLLM's extension, for benchmarks: generate past the end-of-sequence token.
    ignore_eos: bool | None = None


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens."""


class CountTokensResponse(BaseModel):
    """Response of /v1/messages/count_tokens."""

    input_tokens: int


# ---------------------------------------------------------------------------- responses

StopReason = Literal["end_turn", "max_tokens", "stop_sequence"]


class TextBlock(BaseModel):
    """A text content block of the response."""

    type: Literal["text"] = "text"
    text: str


class AnthropicUsage(BaseModel):
    """`usage` of a message: input_tokens excludes the cache-read tokens."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class AnthropicMessage(BaseModel):
    """Response of a non-streamed /v1/messages, and the `message` of message_start."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextBlock]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class MessageStartEvent(BaseModel):
    """First event of a stream: the message with empty content."""

    type: Literal["message_start"] = "message_start"
    message: AnthropicMessage


class ContentBlockStartEvent(BaseModel):
    """Opens content block `index`."""

    type: Literal["content_block_start"] = "content_block_start"
    index: int = 0
    content_block: TextBlock = Field(default_factory=lambda: TextBlock(text=""))


class PingEvent(BaseModel):
    """Keep-alive; the SDK skips it."""

    type: Literal["ping"] = "ping"


class TextDelta(BaseModel):
    """New text of a text block."""

    type: Literal["text_delta"] = "text_delta"
    text: str


class ContentBlockDeltaEvent(BaseModel):
    """A delta of content block `index`."""

    type: Literal["content_block_delta"] = "content_block_delta"
    index: int = 0
    delta: TextDelta


class ContentBlockStopEvent(BaseModel):
    """Closes content block `index`."""

    type: Literal["content_block_stop"] = "content_block_stop"
    index: int = 0


class MessageDelta(BaseModel):
    """Top-level changes of the message: why it stopped."""

    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class MessageDeltaUsage(BaseModel):
    """Cumulative usage sent with message_delta."""

    input_tokens: int | None = None
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


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
