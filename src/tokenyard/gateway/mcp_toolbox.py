"""One request's MCP tools: its servers' sessions, the tools they list (within each
server's `allowed` tools), which server runs which tool, whether a call waits for the
client's approval, and the calls themselves.

The model sees an MCP tool as a function tool of the same name (`Toolbox.tools`); two
tools of one name (across servers, or beside the request's own functions) are a 400.
A server listed in an earlier turn of the conversation (its `mcp_list_tools` item) is
not listed again: its tools come from that item (`known`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenyard.errors import invalid_request
from tokenyard.gateway.mcp_tools import (
    ListedTool,
    McpServer,
    McpUnavailable,
    ServerRefused,
    ToolClient,
    ToolOutcome,
    ToolSession,
)
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.tools import Tool


@dataclass(frozen=True)
class Listing:
    """The tools one server offers this request (what its `mcp_list_tools` item shows),
    and whether they were listed by this request (else read back from an earlier one)."""

    server: McpServer
    tools: tuple[ListedTool, ...]
    fresh: bool


class Toolbox:
    """The request's MCP servers, open (`open`), until `close`."""

    def __init__(self, client: ToolClient, servers: Sequence[McpServer],
                 params: Mapping[str, str]) -> None:
        self.client, self.servers, self.params = client, list(servers), dict(params)
        self.listings: list[Listing] = []
        self._sessions: dict[str, ToolSession] = {}
        self._by_name: dict[str, tuple[McpServer, ListedTool]] = {}
        #: Nanoseconds spent in MCP calls so far (the loop stamps them per hop).
        self.call_ns = 0

    @classmethod
    async def open(cls, client: ToolClient, servers: Sequence[McpServer],
                   params: Mapping[str, str], known: Mapping[str, Sequence[ListedTool]],
                   timeline: Timeline, taken: Sequence[str] = ()) -> Toolbox:
        """Connect to and list each server (unless `known` has its tools); `params`: the
        request field that named each server (by label), for refusals; `taken`: the
        request's own function names. Refuses (400) a server the outbound rules refuse
        and a name clash; 424 for a server that cannot be listed. Stamps `mcp_list`."""
        box = cls(client, servers, params)
        start = time.perf_counter_ns()
        try:
            for server in servers:
                if server.label in known:
                    tools, fresh = list(known[server.label]), False
                else:
                    tools, fresh = await box._list(server), True
                allowed = [t for t in tools if (server.allowed is None
                                                or t.name in server.allowed)
                           and (t.read_only or not server.read_only)]
                box.listings.append(Listing(server, tuple(allowed), fresh))
            box._index(taken)
        except BaseException:
            await box.close()
            raise
        timeline.add("mcp_list", time.perf_counter_ns() - start)
        return box

    async def _list(self, server: McpServer) -> list[ListedTool]:
        session = await self._session(server)  # its refusals as they are
        try:
            return await session.list_tools()
        except Exception as exc:
            raise McpUnavailable(server.label, _reason(exc), self.params[server.label]) \
                from None

    async def _session(self, server: McpServer) -> ToolSession:
        session = self._sessions.get(server.label)
        if session is None:
            try:
                session = await self.client.open(server)
            except ServerRefused as exc:
                raise invalid_request(str(exc), param=self.params[server.label]) from None
            except Exception as exc:
                raise McpUnavailable(server.label, _reason(exc),
                                     self.params[server.label]) from None
            self._sessions[server.label] = session
        return session

    def _index(self, taken: Sequence[str]) -> None:
        for listing in self.listings:
            for tool in listing.tools:
                if tool.name in self._by_name or tool.name in taken:
                    raise invalid_request(
                        f"The tool name '{tool.name}' of MCP server '{listing.server.label}' "
                        "is already taken by another tool of this request.",
                        param=self.params[listing.server.label])
                self._by_name[tool.name] = (listing.server, tool)

    @property
    def tools(self) -> tuple[Tool, ...]:
        """The MCP tools as the model is offered them (function tools)."""
        return tuple(Tool(t.name, t.description, t.input_schema or {"type": "object"}, True)
                     for _, t in self._by_name.values())

    def server_of(self, name: str) -> McpServer | None:
        """The server of MCP tool `name` (None: not an MCP tool of this request)."""
        found = self._by_name.get(name)
        return found[0] if found is not None else None

    def needs_approval(self, name: str) -> bool:
        server = self.server_of(name)
        return server is not None and server.approval.needed(name)

    async def call(self, name: str, arguments: str) -> ToolOutcome:
        """Run MCP tool `name` with `arguments` (JSON text of an object)."""
        server = self.server_of(name)
        assert server is not None, name
        start = time.perf_counter_ns()
        try:
            value = json.loads(arguments or "{}")
            if not isinstance(value, dict):
                return ToolOutcome("The arguments are not a JSON object.", is_error=True)
            try:
                session = await self._session(server)
            except Exception as exc:
                return ToolOutcome(f"The MCP server could not be reached: {_reason(exc)}",
                                   is_error=True, failure=type(exc).__name__)
            return await session.call_tool(name, value)
        except ValueError:
            return ToolOutcome("The arguments are not valid JSON.", is_error=True)
        finally:
            self.call_ns += time.perf_counter_ns() - start

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()


def _reason(exc: BaseException) -> str:
    """A failure's kind and message for the client, without anything the server sent
    back beyond the first line (no headers, no secrets of ours)."""
    text = str(getattr(exc, "message", None) or exc).splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
