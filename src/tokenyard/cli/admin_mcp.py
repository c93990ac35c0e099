"""`tokenyard admin mcp …`: the MCP registry from a terminal (`gateway/mcp_registry.py`).

    tokenyard admin mcp add --org org_… --label calc --url http://10.0.0.5:8000/mcp \\
        [--header 'Authorization: Bearer …'] [--allowed-tool add ...] \\
        [--require-approval always|never] [--description TEXT]
    tokenyard admin mcp list [--org org_…]          (header names, never their values)
    tokenyard admin mcp remove mcp_…
    tokenyard admin mcp grant mcp_… --key key_… | --project proj_… [--tool add ...]
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

from tokenyard.gateway import mcp_registry as registry
from tokenyard.gateway.admin import Admin, AdminError

Operation = Callable[[Admin], Awaitable[Any]]


def add_mcp_parsers(nouns: Any, fmt: argparse.ArgumentParser) -> None:
    """The `mcp` noun."""
    mcp = nouns.add_parser("mcp", parents=[fmt],
        help="the MCP servers an org's requests may reach, and who may call their tools"
        ).add_subparsers(dest="verb", required=True)
    add = mcp.add_parser("add", parents=[fmt], help="register an MCP server for an org")
    add.add_argument("--org", dest="org_id", required=True)
    add.add_argument("--label", required=True, help="the name requests call it by")
    add.add_argument("--url", required=True)
    add.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                     help="sent with every call (a secret: never shown again)")
    add.add_argument("--allowed-tool", action="append", dest="allowed_tools",
                     metavar="TOOL", help="the only tools it offers (default: all)")
    add.add_argument("--require-approval", choices=list(registry.APPROVALS))
    add.add_argument("--description")
    listing = mcp.add_parser("list", parents=[fmt], help="registered servers")
    listing.add_argument("--org", dest="org_id")
    remove = mcp.add_parser("remove", parents=[fmt], help="remove a server and its grants")
    remove.add_argument("server_id")
    grant = mcp.add_parser("grant", parents=[fmt],
                           help="let a key or a project call a server's tools")
    grant.add_argument("server_id")
    who = grant.add_mutually_exclusive_group(required=True)
    who.add_argument("--key", dest="key_id")
    who.add_argument("--project", dest="project_id")
    grant.add_argument("--tool", action="append", dest="tools", metavar="TOOL",
                       help="the tools it may call (default: all)")


def _headers(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise AdminError("header", f"--header {line!r}: write it as 'NAME: VALUE'")
        out[name.strip()] = value.strip()
    return out


def mcp_operations(args: argparse.Namespace, a: dict[str, Any]
                   ) -> dict[tuple[str, str | None], Operation]:
    """The `mcp` verbs, for `cli/admin.py`'s table (`a`: the arguments given)."""
    return {
        ("mcp", "add"): lambda ad: registry.register_server(
            ad.store, args.org_id, {**a, "headers": _headers(args.header)}),
        ("mcp", "list"): lambda ad: registry.list_servers(ad.store, a.get("org_id")),
        ("mcp", "remove"): lambda ad: registry.remove_server(ad.store, args.server_id),
        ("mcp", "grant"): lambda ad: registry.grant(ad.store, args.server_id, a),
    }
