"""MCP tools as the gateway's loop sees them: a server resolved for one request, the
tools it lists, a call's outcome, and the protocol of the client that reaches servers
(`api/mcp_client.py` implements it with the official `mcp` SDK over streamable HTTP;
the pipeline's builder hands it in, as it does the image stage).

A server's `headers` are secrets (an admin's registered token, the request's own
`headers`/`authorization`): they go to that server and nowhere else: not into
`repr`, a log line, a request record or a response body.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from tokenyard.errors import APIError

#: OpenAI's rule when `require_approval` is absent: every call waits for approval.
DEFAULT_APPROVAL: Literal["always"] = "always"


@dataclass(frozen=True)
class Approval:
    """Which tools of a server need the client's approval before they run: `default`
    for tools named in neither list."""

    default: Literal["always", "never"] = DEFAULT_APPROVAL
    always: frozenset[str] = frozenset()
    never: frozenset[str] = frozenset()

    def needed(self, tool: str) -> bool:
        if tool in self.always:
            return True
        if tool in self.never:
            return False
        return self.default == "always"


NEVER = Approval("never")


@dataclass(frozen=True)
class McpServer:
    """One MCP server as a request may use it. `allowed`: the tools it may call (None:
    every one listed); `registered`: an admin registered it (its address may then be
    private or loopback; otherwise only public addresses are reached)."""

    label: str
    url: str
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    allowed: frozenset[str] | None = None
    approval: Approval = NEVER
    registered: bool = False
    description: str | None = None
    #: Only the tools annotated read-only (`readOnlyHint`) are offered.
    read_only: bool = False


@dataclass(frozen=True)
class ListedTool:
    """A tool a server lists: its name, description and arguments' JSON schema;
    `read_only` from its annotations (`readOnlyHint`)."""

    name: str
    description: str | None
    input_schema: dict[str, Any]
    read_only: bool = False
    annotations: dict[str, Any] | None = None


@dataclass(frozen=True)
class ToolOutcome:
    """What a call returned: its content as text, and whether the tool reported an error
    (`is_error`) or the call itself failed (`failure`: unreachable, protocol error)."""

    text: str
    is_error: bool = False
    failure: str | None = None


class ToolSession(Protocol):
    """One connection to one server, for one request's loop."""

    async def list_tools(self) -> list[ListedTool]: ...

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolOutcome: ...

    async def close(self) -> None: ...


class ToolClient(Protocol):
    """Opens sessions on servers (the outbound fetch rules apply: `McpServer.registered`)."""

    async def open(self, server: McpServer) -> ToolSession: ...


class McpUnavailable(APIError):
    """424: a server could not be reached or listed before the response began (OpenAI's
    status for a failed MCP dependency), naming the request's tool."""

    def __init__(self, label: str, reason: str, param: str = "tools") -> None:
        super().__init__(424, f"Error retrieving tool list from MCP server '{label}': "
                         f"{reason}", type="external_connector_error", param=param,
                         code="mcp_server_unavailable")


class ServerRefused(ValueError):
    """A server's URL breaks the outbound fetch rules (not http(s), a host that does not
    resolve, an address that is not public for a server no admin registered); the
    message says which, for the client."""
