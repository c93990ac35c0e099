"""The Responses API's MCP parts of a request: the `mcp` tool and the MCP items a
conversation carries back (`mcp_list_tools`, `mcp_call`, `mcp_approval_request`, and the
client's `mcp_approval_response`). OpenAI's shapes; `api/responses/mcp.py` runs them.

What is not offered here is a 400 naming it: `connector_id` (OpenAI's hosted
connectors; a connector here is a server an admin registered, named by `server_label`),
`tunnel_id`, and `defer_loading` true (no tool search).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from tokenyard.api.errors import schema_error
from tokenyard.api.schemas import Identifier, RequestModel
from tokenyard.errors import INVALID_VALUE, UNSUPPORTED_PARAMETER

#: A server URL's longest form (as long as the registry keeps).
ServerURL = Annotated[str, Field(max_length=2048)]
#: A header value or token sent to an MCP server (a secret: never kept or logged).
Secret = Annotated[str, Field(max_length=8192)]
ToolName = Annotated[str, Field(max_length=128)]


class ToolFilter(RequestModel):
    """`allowed_tools` / an approval list as an object: tools by name (and, for allowed
    tools, only the read-only ones with `read_only`)."""

    tool_names: list[ToolName] | None = None
    read_only: bool | None = None


class ApprovalFilter(RequestModel):
    """`require_approval` per tool: these always, those never (the rest: always)."""

    always: ToolFilter | None = None
    never: ToolFilter | None = None


class McpTool(RequestModel):
    """``{"type": "mcp", "server_label", "server_url" | a registered label, ...}``."""

    type: Literal["mcp"]
    server_label: Identifier
    server_url: ServerURL | None = None
    server_description: Identifier | None = None
    headers: dict[Identifier, Secret] | None = None
    authorization: Secret | None = None
    allowed_tools: list[ToolName] | ToolFilter | None = None
    require_approval: Literal["always", "never"] | ApprovalFilter | None = None
    connector_id: Identifier | None = None
    tunnel_id: Identifier | None = None
    defer_loading: bool | None = None
    allowed_callers: list[Identifier] | None = None

    @model_validator(mode="after")
    def _check(self) -> McpTool:
        for name in ("connector_id", "tunnel_id"):
            if getattr(self, name) is not None:
                raise schema_error(UNSUPPORTED_PARAMETER, name, f"'{name}' is not supported "
                                   "by this server; give 'server_url', or the "
                                   "'server_label' of a server an admin registered.")
        if self.defer_loading:
            raise schema_error(UNSUPPORTED_PARAMETER, "defer_loading", "Deferred MCP tools "
                               "are not supported: this server has no tool search.")
        if self.server_url is not None and not self.server_url.startswith(
                ("http://", "https://")):
            raise schema_error(INVALID_VALUE, "server_url", "'server_url' must be an http "
                               "or https URL.")
        return self

    def echo(self) -> dict[str, Any]:
        """The tool as the response echoes it: without its secrets."""
        return self.model_dump(mode="json", exclude_none=True,
                               exclude={"headers", "authorization"})


class McpListToolsItem(RequestModel):
    """An earlier response's list of a server's tools (not listed again)."""

    type: Literal["mcp_list_tools"]
    id: Identifier | None = None
    server_label: Identifier
    tools: list[dict[str, Any]] = Field(default_factory=list)
    error: str | None = None


class McpCallItem(RequestModel):
    """A call the platform ran in an earlier response, with its output or error."""

    type: Literal["mcp_call"]
    id: Identifier | None = None
    server_label: Identifier
    name: ToolName
    arguments: str = ""
    output: str | None = None
    error: Any = None
    status: Identifier | None = None
    approval_request_id: Identifier | None = None

    @property
    def result_of(self) -> tuple[str, str, bool]:
        """What the model read of it: (text, tool name, whether it is an error)."""
        error = self.error
        text = self.output
        if text is None and isinstance(error, dict):
            text = str(error.get("message") or error.get("type") or "")
        elif text is None:
            text = "The call returned nothing." if error is None else str(error)
        return text, self.name, error is not None


class McpApprovalRequestItem(RequestModel):
    """A call an earlier response left waiting for the client's approval."""

    type: Literal["mcp_approval_request"]
    id: Identifier
    server_label: Identifier
    name: ToolName
    arguments: str = ""


class McpApprovalResponseItem(RequestModel):
    """The client's answer to approval request `approval_request_id`."""

    type: Literal["mcp_approval_response"]
    approval_request_id: Identifier
    approve: bool
    id: Identifier | None = None
    reason: Identifier | None = None


McpItem = McpListToolsItem | McpCallItem | McpApprovalRequestItem | McpApprovalResponseItem
#: Each MCP item's type → its tag in the request's item union.
MCP_ITEM_TAGS = {"mcp_list_tools": "McpList", "mcp_call": "McpCall",
                 "mcp_approval_request": "McpApprovalRequest",
                 "mcp_approval_response": "McpApprovalResponse"}
