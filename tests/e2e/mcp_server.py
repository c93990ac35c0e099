"""The MCP server of the tests of the platform's MCP loop: `tokenyard.bench.mcp_server`'s."""

from tokenyard.bench.mcp_server import requests_seen, running_mcp_server

__all__ = ["requests_seen", "running_mcp_server"]
