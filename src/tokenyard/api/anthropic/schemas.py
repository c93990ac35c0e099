"""Bodies of the Anthropic-compatible endpoints: /v1/messages and /v1/messages/count_tokens.

Requests: `max_tokens` is required (as Anthropic requires it), `system` is a string or a list
of text blocks, message content is a string or a list of blocks of which `text`,
`tool_use` (assistant), `tool_result` and `image` (user) are supported; document and
thinking blocks are answered with a 400 naming them. `tools` are client tools (name,
description, input_schema); `tool_choice` is auto, any, tool or none (auto and none also
without tools). The other top-level options are `api.anthropic.request_fields`'s; a
top-level field no version of the API documents is a 400 naming it, in Anthropic's error
shape. Fields unknown inside nested objects are ignored (an SDK's response blocks sent
back as a conversation carry extra ones).

Responses and stream events mirror Anthropic's shapes so the official SDK parses them. Usage
follows Anthropic's accounting: `input_tokens` counts the prompt tokens that were *not* read
from the cache; `cache_read_input_tokens` the ones that were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, ValidationError, model_validator

from tokenyard.api.anthropic.mcp_schemas import McpServerURL
from tokenyard.api.anthropic.request_fields import (
    REFUSED,
    ConversationOptions,
    GenerationOptions,
)
from tokenyard.api.anthropic.tool_schemas import (
    McpToolResultBlock,
    McpToolUseBlock,
    ToolChoiceParam,
    ToolParam,
    ToolUseBlock,
    ToolUseBlockParam,
)
from tokenyard.api.errors import schema_error
from tokenyard.api.images import (
    anthropic_source_uri,
    only_from_user,
    source_problem,
)
from tokenyard.api.schemas import (
    TEXT_PART_SEPARATOR,
    Acceptable,
    ModelName,
    RequestModel,
    StopString,
    reject_unknown,
    reject_unsupported,
)
from tokenyard.errors import INVALID_VALUE, UNSUPPORTED_VALUE
from tokenyard.text.content import ImagePart
from tokenyard.wire.protocol import TTL_1H, TTL_5M

# ---------------------------------------------------------------------------- requests

_UNSUPPORTED_BLOCKS = frozenset(
    {
        "image",
        "document",
        "search_result",
        "server_tool_use",
        "web_search_tool_result",
        "thinking",
        "redacted_thinking",
        "container_upload",
    }
)


#: Anthropic's limit on `cache_control` breakpoints in one request.
MAX_CACHE_BREAKPOINTS = 4


class CacheControl(RequestModel):
    """``{"type": "ephemeral", "ttl": "5m" | "1h"}``: a prompt-cache breakpoint. The prompt
    up to and including the block it marks is kept for the TTL, refreshed by every hit."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def seconds(self) -> float:
        """The TTL in seconds."""
        return TTL_1H if self.ttl == "1h" else TTL_5M


def _breakpoint_ttl(value: Any) -> float | None:
    """The TTL (seconds) of a block's `cache_control`, or None when it has none."""
    if value is None:
        return None
    if isinstance(value, CacheControl):
        return value.seconds
    try:  # a block type that leaves the field untyped
        return CacheControl.model_validate(value).seconds
    except ValidationError:
        return TTL_5M


class TextBlockParam(RequestModel):
    """``{"type": "text", "text": ...}`` in a message or in `system`."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None

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


class ImageSource(RequestModel):
    """An image block's `source`: ``{"type": "base64", "media_type", "data"}`` or
    ``{"type": "url", "url"}``, checked without a fetch (`api/images.source_problem`)."""

    type: Literal["base64", "url"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ImageSource:
        field = "data" if self.type == "base64" else "url"
        if self.type == "base64" and self.media_type is None:
            raise schema_error(INVALID_VALUE, "media_type",
                               "a base64 image source needs a 'media_type'.")
        if getattr(self, field) is None:
            raise schema_error(INVALID_VALUE, field,
                               f"a {self.type} image source needs '{field}'.")
        problem = source_problem(self.uri)
        if problem is not None:
            raise schema_error(INVALID_VALUE, field, problem)
        return self

    @property
    def uri(self) -> str:
        """The data URI or URL this source stands for."""
        return anthropic_source_uri(self.model_dump())


class ImageBlockParam(RequestModel):
    """``{"type": "image", "source": ...}`` in a user message."""

    type: Literal["image"]
    source: ImageSource
    cache_control: Any = None

    def image_part(self, param: str) -> ImagePart:
        """This block as the template message's `ImagePart`, named `param`."""
        return ImagePart(param, self.source.uri)


class ToolResultBlockParam(RequestModel):
    """``{"type": "tool_result", "tool_use_id", "content", "is_error"}`` in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam] | None = None
    is_error: bool | None = None
    cache_control: Any = None

    @property
    def text(self) -> str:
        return "" if self.content is None else blocks_text(self.content)


_BLOCK_TAGS = {"image": "Image", "tool_use": "ToolUse", "tool_result": "ToolResult"}


def _block_kind(data: Any) -> str:
    found = data.get("type") if isinstance(data, dict) else getattr(data, "type", None)
    return _BLOCK_TAGS.get(found, "Text") if isinstance(found, str) else "Text"


#: A message's content block by its type; anything else is validated as text (whose
#: model names the types it refuses).
ContentBlockParam = Annotated[
    Annotated[TextBlockParam, Tag("Text")] | Annotated[ImageBlockParam, Tag("Image")]
    | Annotated[ToolUseBlockParam, Tag("ToolUse")]
    | Annotated[ToolResultBlockParam, Tag("ToolResult")],
    Discriminator(_block_kind),
]


def blocks_text(content: str | Sequence[Any]) -> str:
    """Content (a string or blocks) as one string of its text."""
    if isinstance(content, str):
        return content
    return TEXT_PART_SEPARATOR.join(
        block.text for block in content if isinstance(block, TextBlockParam)
    )


class MessageParam(RequestModel):
    """One message of `messages`."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlockParam]

    @model_validator(mode="after")
    def _images_from_user(self) -> MessageParam:
        only_from_user(self.role, self.content, "image blocks")
        for i, block in enumerate(() if isinstance(self.content, str) else self.content):
            wrong = ((isinstance(block, ToolUseBlockParam) and self.role != "assistant")
                     or (isinstance(block, ToolResultBlockParam) and self.role != "user"))
            if wrong:
                raise schema_error(INVALID_VALUE, f"content.{i}.type",
                                   f"'{block.type}' blocks are not allowed in '{self.role}' "
                                   "messages.")
        return self

    @property
    def text(self) -> str:
        """The content as one string."""
        return blocks_text(self.content)


class _Conversation(ConversationOptions):
    model: ModelName
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    #: Automatic caching: a breakpoint on the last block of the last message.
    cache_control: CacheControl | None = None

    #: Documented fields this route refuses when set (`request_fields.REFUSED`).
    refused: ClassVar[dict[str, Acceptable]] = REFUSED

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        reject_unsupported(data, cls.refused)
        reject_unknown(data, [*cls.model_fields, *REFUSED])
        if isinstance(data, dict) and data.get("output_format") is not None and isinstance(
                data.get("output_config"), dict) and data["output_config"].get("format"):
            raise schema_error(INVALID_VALUE, "output_format",
                               "'output_format' and 'output_config.format' cannot be used "
                               "together.")
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

    @model_validator(mode="after")
    def _check_tools(self) -> _Conversation:
        names = [t.name for t in self.tools or ()]
        choice = self.tool_choice
        servers = bool(getattr(self, "mcp_servers", None))  # their tools: known once listed
        if choice is not None and choice.type == "any" and not names and not servers:
            raise schema_error(INVALID_VALUE, "tool_choice",
                               f"tool_choice.type '{choice.type}' needs 'tools'.")
        if (choice is not None and choice.type == "tool" and choice.name not in names
                and not servers):
            raise schema_error(INVALID_VALUE, "tool_choice.name",
                               f"tool_choice names the tool {choice.name!r}, which is not "
                               "among 'tools'.")
        if len(set(names)) != len(names):
            raise schema_error(INVALID_VALUE, "tools", "Tool names must be unique.")
        return self

    @model_validator(mode="after")
    def _check_cache_breakpoints(self) -> _Conversation:
        found = len(self.cache_breakpoints())
        if found > MAX_CACHE_BREAKPOINTS:
            raise schema_error(
                INVALID_VALUE, None,
                f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be "
                f"provided. Found {found}.",
            )
        return self

    def cache_breakpoints(self) -> list[tuple[int | None, int, float]]:
        """Every block with `cache_control`, in prompt order, then the top-level one's
        (the last message's last block; a string content is its block 0): (message
        index, None for `system`; block index; TTL in seconds)."""
        places: list[tuple[int | None, str | Sequence[Any] | None]] = [
            (None, self.system), *((i, m.content) for i, m in enumerate(self.messages))
        ]
        found: list[tuple[int | None, int, float]] = []
        for index, content in places:
            for j, block in enumerate(() if isinstance(content, str) else content or ()):
                ttl = _breakpoint_ttl(getattr(block, "cache_control", None))
                if ttl is not None:
                    found.append((index, j, ttl))
        if self.cache_control is not None:  # automatic: the last block of the last message
            last = len(self.messages) - 1
            content = self.messages[last].content
            block = 0 if isinstance(content, str) else max(len(content) - 1, 0)
            if not found or found[-1][:2] != (last, block):
                found.append((last, block, self.cache_control.seconds))
        return found

    @property
    def system_text(self) -> str | None:
        """`system` as one string, or None when absent."""
        return None if self.system is None else blocks_text(self.system)


class MessagesRequest(_Conversation, GenerationOptions):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[StopString] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool | None = None
    #: vLLM's extension, for benchmarks: generate past the end-of-sequence token.
    ignore_eos: bool | None = None
    #: MCP servers whose tools the platform runs (`api/anthropic/mcp.py`).
    mcp_servers: list[McpServerURL] | None = None

    #: Documented fields refused here: all of REFUSED but `mcp_servers`, which runs.
    refused: ClassVar[dict[str, Acceptable]] = {
        k: ok for k, ok in REFUSED.items() if k != "mcp_servers"}


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens."""


class CountTokensResponse(BaseModel):
    """Response of /v1/messages/count_tokens."""

    input_tokens: int


# ---------------------------------------------------------------------------- responses

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]


class TextBlock(BaseModel):
    """A text content block of the response."""

    type: Literal["text"] = "text"
    text: str
    #: The spec marks it required (null when there are none), but Anthropic's API leaves
    #: it out when nothing is cited, and clients hold to that: the Vercel AI SDK refuses
    #: a null (`citations: z.array().optional()`). Left out, as the API does; the
    #: conformance suite lists the conflict (tests/conformance/test_anthropic.py).
    citations: None = Field(default=None, exclude=True)


class ThinkingBlock(BaseModel):
    """A reasoning model's thinking (text/reasoning.py), before its answer. Anthropic
    signs its own so they can be sent back; nothing is signed here (empty)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


ResponseBlock = (TextBlock | ToolUseBlock | ThinkingBlock | McpToolUseBlock
                 | McpToolResultBlock)


class CacheCreation(BaseModel):
    """`usage.cache_creation`: the prompt-cache writes by how long they are kept."""

    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class OutputTokensDetails(BaseModel):
    """`usage.output_tokens_details`: the output tokens a reasoning model spent in its
    thinking block."""

    thinking_tokens: int = 0


class AnthropicUsage(BaseModel):
    """`usage` of a message: input_tokens excludes the cache-read and cache-written
    tokens; `cache_creation` splits the written ones by TTL. No server tools run here
    (`server_tool_use` null); every request is served at the standard tier, in no named
    region (`inference_geo` null). The spec requires every field, null or not."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation: CacheCreation = Field(default_factory=CacheCreation)
    server_tool_use: None = None
    service_tier: Literal["standard"] = "standard"
    inference_geo: None = None
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class AnthropicMessage(BaseModel):
    """Response of a non-streamed /v1/messages, and the `message` of message_start."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ResponseBlock]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    #: Details of a refusal (the only kind the spec has); none is made here.
    stop_details: None = None
    usage: AnthropicUsage
    container: None = None  # no code-execution container runs here
