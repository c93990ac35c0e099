"""The MCP server of the tests of the platform's MCP loop: `tokenyard.bench.mcp_server`'s."""

from tokenyard.bench.mcp_server import running_mcp_server

__all__ = ["running_mcp_server"]
