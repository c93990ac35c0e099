"""`mcp_servers` of a /v1/messages request (Anthropic's MCP connector, a beta field): the
servers whose tools the platform runs between the model's turns (`api/anthropic/mcp.py`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from tokenyard.api.errors import schema_error
from tokenyard.api.schemas import Identifier, RequestModel
from tokenyard.errors import INVALID_VALUE

ToolName = Annotated[str, Field(max_length=128)]


class McpToolConfiguration(RequestModel):
    """`tool_configuration`: whether the server's tools are offered, and which."""

    enabled: bool | None = None
    allowed_tools: list[ToolName] | None = None


class McpServerURL(RequestModel):
    """``{"type": "url", "url", "name", "authorization_token"?, "tool_configuration"?}``."""

    type: Literal["url"]
    url: Annotated[str, Field(max_length=2048)]
    name: Identifier
    authorization_token: Annotated[str, Field(max_length=8192)] | None = None
    tool_configuration: McpToolConfiguration | None = None

    @model_validator(mode="after")
    def _check(self) -> McpServerURL:
        if not self.url.startswith(("http://", "https://")):
            raise schema_error(INVALID_VALUE, "url", "An MCP server's 'url' must be an http "
                               "or https URL.")
        return self

    @property
    def enabled(self) -> bool:
        return self.tool_configuration is None or self.tool_configuration.enabled is not False
