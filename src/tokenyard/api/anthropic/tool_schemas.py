"""The Anthropic API's tool models: the client tools a request offers, its `tool_choice`,
the `tool_use` blocks of a conversation or a response.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from tokenyard.api.schemas import RequestModel

#: A tool's name, as Anthropic allows it.
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class ToolUseBlockParam(RequestModel):
    """``{"type": "tool_use", "id", "name", "input"}``: a call an assistant turn made."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None


class ToolParam(RequestModel):
    """One of `tools`: a client tool (name, description, its input's JSON schema)."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: Any = None



class ToolChoiceParam(RequestModel):
    """`tool_choice`: auto, any (at least one call), tool (that one, `name`) or none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None



class DirectCaller(BaseModel):
    """`caller` of a tool_use block: ``{"type": "direct"}``, a call the model made."""

    type: Literal["direct"] = "direct"


class ToolUseBlock(BaseModel):
    """A tool_use content block of the response: the call's id, tool and input."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]
    #: Who made the call: always the model itself here (no code-execution tool runs).
    caller: DirectCaller = Field(default_factory=lambda: DirectCaller())


class McpToolUseBlock(BaseModel):
    """An mcp_tool_use content block: a call the platform made on MCP server
    `server_name` (the request's `mcp_servers`), its result in the next block."""

    type: Literal["mcp_tool_use"] = "mcp_tool_use"
    id: str
    name: str
    server_name: str
    input: dict[str, Any]


class McpToolResultBlock(BaseModel):
    """An mcp_tool_result content block: what the call `tool_use_id` returned, as text
    blocks (the spec's text block, `citations` null)."""

    type: Literal["mcp_tool_result"] = "mcp_tool_result"
    tool_use_id: str
    is_error: bool = False
    content: list[dict[str, Any]]
