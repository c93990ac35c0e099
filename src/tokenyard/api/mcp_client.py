"""The gateway's MCP client (`gateway.mcp_tools.ToolClient`): the official `mcp` SDK over
streamable HTTP, under the image fetch's outbound rules (`api/image_fetch.py`).

A server's URL is checked and its host resolved once, here: a server no admin registered
must resolve to public addresses only (`is_public_address`), a registered one may be
anywhere (loopback included). Every connection of the session then goes to exactly the
addresses checked (`_PinnedTransport`), so a second lookup cannot rebind it; the SDK
follows a redirect only within the server's origin. Calls have a deadline
(`CALL_TIMEOUT_S`). A server's headers (its secrets) go only into its own requests.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import ssl
from typing import Any

import httpx2

from tokenyard.api.image_fetch import (
    AddressPolicy,
    ImageRejected,
    IPAddress,
    Resolver,
    check_url,
    checked_addresses,
    is_public_address,
    system_resolver,
)
from tokenyard.gateway.mcp_tools import ListedTool, McpServer, ServerRefused, ToolOutcome

logger = logging.getLogger("tokenyard.api")

#: Seconds one list or call may take (connecting included).
CALL_TIMEOUT_S = 30.0
#: The most characters of a tool's text output kept for the model and the response.
MAX_OUTPUT_CHARS = 64 * 1024


def _anywhere(address: IPAddress) -> bool:
    return True


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The TLS settings of every session, made once: loading the CA bundle for each
    session's transport was most of the CPU an agent task's MCP work cost the gateway."""
    return httpx2.create_ssl_context()


class _PinnedTransport(httpx2.AsyncHTTPTransport):
    """Sends every request for `host` to `address` (TLS still verifies `host`)."""

    def __init__(self, host: str, address: IPAddress) -> None:
        super().__init__(verify=_tls_context(), retries=0)
        self._host, self._address = host, address

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.url.host != self._host:
            raise httpx2.ConnectError(f"{request.url.host!r} was not resolved for this server")
        request.extensions = {**request.extensions, "sni_hostname": self._host}
        request.url = request.url.copy_with(host=str(self._address))
        return await super().handle_async_request(request)


def listed(tool: Any) -> ListedTool:
    """An SDK `Tool` as the loop's `ListedTool`."""
    annotations = (tool.annotations.model_dump(mode="json", by_alias=True, exclude_none=True)
                   if tool.annotations is not None else None)
    return ListedTool(tool.name, tool.description, dict(tool.input_schema or {}),
                      bool(annotations and annotations.get("readOnlyHint")), annotations)


def outcome(result: Any) -> ToolOutcome:
    """An SDK `CallToolResult` as text: its text parts joined, else its structured
    content as JSON, else each other part as JSON."""
    parts = [p.text for p in result.content if getattr(p, "type", None) == "text"]
    if not parts and result.structured_content is not None:
        parts = [json.dumps(result.structured_content, ensure_ascii=False)]
    if not parts:
        parts = [json.dumps(p.model_dump(mode="json", exclude_none=True)) for p in result.content]
    return ToolOutcome("\n".join(parts)[:MAX_OUTPUT_CHARS], is_error=bool(result.is_error))


class McpSession:
    """One connected session on one server (`ToolSession`)."""

    def __init__(self, server: McpServer, stack: contextlib.AsyncExitStack,
                 client: Any) -> None:
        self.server, self._stack, self._client = server, stack, client

    async def list_tools(self) -> list[ListedTool]:
        result = await self._client.list_tools()
        return [listed(t) for t in result.tools]

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        try:
            result = await self._client.call_tool(name, arguments)
        except Exception as exc:  # the server or the connection failed: the model is told
            logger.warning("MCP call %s on %s failed: %r", name, self.server.label, exc)
            return ToolOutcome(f"The call failed: {type(exc).__name__}.", is_error=True,
                               failure=type(exc).__name__)
        return outcome(result)

    async def close(self) -> None:
        try:
            await self._stack.aclose()
        except Exception:  # the session's end is best effort: the answer is out
            logger.debug("closing the MCP session on %s failed", self.server.label,
                         exc_info=True)


class McpClient:
    """Opens `McpSession`s (`ToolClient`). `allow` and `resolve` as in the image fetch:
    tests may point names anywhere without touching the default."""

    def __init__(self, *, allow: AddressPolicy = is_public_address,
                 resolve: Resolver = system_resolver,
                 timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.allow, self.resolve, self.timeout_s = allow, resolve, timeout_s

    async def open(self, server: McpServer) -> McpSession:
        """A session on `server`: ServerRefused for a URL the rules refuse; any other
        failure to connect raises as it is (the loop names the server)."""
        what = "MCP server URL"
        try:
            url = check_url(server.url, what)
            addresses = await checked_addresses(
                url, _anywhere if server.registered else self.allow, self.resolve, what)
        except ImageRejected as exc:
            raise ServerRefused(str(exc)[:1].upper() + str(exc)[1:]) from None
        assert url.raw_host is not None  # checked by check_url
        # Imported on first use: the SDK brings OpenTelemetry's API, which the HTTP process
        # loads only when tracing is on (tests/unit/test_tracing.py).
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        http = httpx2.AsyncClient(
            headers=dict(server.headers), trust_env=False,
            transport=_PinnedTransport(url.raw_host, addresses[0]),
            timeout=httpx2.Timeout(self.timeout_s))
        stack = contextlib.AsyncExitStack()
        try:
            await stack.enter_async_context(http)
            client = Client(streamable_http_client(server.url, http_client=http),
                            mode="legacy", read_timeout_seconds=self.timeout_s)
            await stack.enter_async_context(client)
        except BaseException:
            await stack.aclose()
            raise
        return McpSession(server, stack, client)
