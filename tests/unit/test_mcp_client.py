"""api/mcp_client.py's outbound sessions."""

from __future__ import annotations

import ipaddress

from tokenyard.api.mcp_client import _PinnedTransport


def test_every_session_shares_one_tls_context() -> None:
    # Loading the CA bundle for each session's transport was most of the gateway's CPU
    # for an agent task's MCP work; it is made once.
    loopback = ipaddress.ip_address("127.0.0.1")
    a, b = _PinnedTransport("a.example", loopback), _PinnedTransport("b.example", loopback)
    assert a._pool._ssl_context is b._pool._ssl_context
