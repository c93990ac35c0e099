"""The MCP registry per org: which servers an org's requests may reach beyond the public
internet, with which secrets, and which keys or projects may call which of their tools.

    POST   /admin/v1/orgs/{org_id}/mcp_servers   {label, url, headers?, allowed_tools?,
                                                  require_approval?, description?}
    GET    /admin/v1/orgs/{org_id}/mcp_servers   (header names, never their values)
    DELETE /admin/v1/mcp_servers/{server_id}
    POST   /admin/v1/mcp_servers/{server_id}/grants  {key_id | project_id, tools?}
    tokenyard admin mcp add|list|remove|grant            (cli/admin_mcp.py)

A request names a server by its label alone (a connector the admin registered) or by
URL; a URL that an admin registered for the key's org is that server, with its headers
and rules. A registered server may be on a private or loopback address; any other URL
must resolve to public addresses only (`api/mcp_client.py`, the image fetch's rules).
A server without grants is open to every key of its org; with grants, a key calls it
only through a grant naming the key or its project, and only the grant's tools.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tokenyard.errors import APIError, invalid_request
from tokenyard.gateway.admin import AdminError, Json, NotFound
from tokenyard.gateway.mcp_tools import Approval, McpServer
from tokenyard.store import mcp_servers as stored
from tokenyard.store.ids import new_id
from tokenyard.store.mcp_servers import McpGrant, McpServerRecord
from tokenyard.store.mcp_tables import URL_CHARS
from tokenyard.store.records import KeyContext
from tokenyard.store.repo import Store

APPROVALS = ("always", "never")


# ---------------------------------------------------------------------------- administration


def _tool_names(args: Mapping[str, Any], name: str) -> tuple[str, ...] | None:
    value = args.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise AdminError(name, f"{name} must be a list of tool names, or null (every tool)")
    return tuple(sorted(set(value)))


def _headers(args: Mapping[str, Any]) -> dict[str, str]:
    value = args.get("headers") or {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) for k, v in value.items()):
        raise AdminError("headers", "headers must be an object of header names to strings")
    return dict(value)


def server_json(record: McpServerRecord) -> Json:
    """A registered server as the admin API shows it: its header names, not their values."""
    return {
        "id": record.id, "org_id": record.org_id, "label": record.label, "url": record.url,
        "headers": list(record.header_names),
        "allowed_tools": None if record.allowed_tools is None else list(record.allowed_tools),
        "require_approval": record.require_approval, "description": record.description,
        "created_at": record.created_at.isoformat(),
        "grants": [{"subject": g.subject, "subject_id": g.subject_id,
                    "tools": None if g.tools is None else list(g.tools)}
                   for g in record.grants],
    }


async def register_server(store: Store, org_id: str, args: Mapping[str, Any]) -> Json:
    """Register an MCP server for an org (its label unique in the org)."""
    if await store.get_org(org_id) is None:
        raise NotFound("org_id", f"no org {org_id}")
    label, url = args.get("label"), args.get("url")
    if not isinstance(label, str) or not label or len(label) > 64:
        raise AdminError("label", "label must be a name of 1 to 64 characters")
    if (not isinstance(url, str) or not url.startswith(("http://", "https://"))
            or len(url) > URL_CHARS):
        raise AdminError("url", "url must be an http(s) URL")
    approval = args.get("require_approval")
    if approval is not None and approval not in APPROVALS:
        raise AdminError("require_approval", "require_approval must be 'always', 'never' "
                                             "or null (the request's own rule)")
    description = args.get("description")
    record = McpServerRecord(
        id=new_id("mcp"), org_id=org_id, label=label, url=url, headers=_headers(args),
        allowed_tools=_tool_names(args, "allowed_tools"), require_approval=approval,
        description=description if isinstance(description, str) else None,
        created_at=datetime.now(UTC))
    if not await stored.insert_server(store.db.engine, record):
        raise AdminError("label", f"org {org_id} already has an MCP server labelled {label!r}")
    return server_json((await stored.servers(store.db.engine, org_id,
                                             server_id=record.id))[0])


async def list_servers(store: Store, org_id: str | None) -> list[Json]:
    """The registered servers (of one org, or every org's), without their secrets."""
    return [server_json(r) for r in await stored.servers(store.db.engine, org_id)]


async def remove_server(store: Store, server_id: str) -> Json:
    if not await stored.delete_server(store.db.engine, server_id):
        raise NotFound("server_id", f"no MCP server {server_id}")
    return {"id": server_id, "deleted": True}


async def grant(store: Store, server_id: str, args: Mapping[str, Any]) -> Json:
    """Let a key or a project call a server's `tools` (null: all it offers; [] : none),
    replacing that subject's grant."""
    key_id, project_id = args.get("key_id"), args.get("project_id")
    if (key_id is None) == (project_id is None):
        raise AdminError("key_id", "name exactly one of key_id and project_id")
    subject, subject_id = ("key", key_id) if key_id is not None else ("project", project_id)
    if not isinstance(subject_id, str) or not subject_id:
        raise AdminError(f"{subject}_id", f"{subject}_id must be an id")
    entry = McpGrant(subject, subject_id, _tool_names(args, "tools"))
    if not await stored.set_grant(store.db.engine, server_id, entry):
        raise NotFound("server_id", f"no MCP server {server_id}")
    return {"server_id": server_id, "subject": subject, "subject_id": subject_id,
            "tools": None if entry.tools is None else list(entry.tools)}


# ---------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class RequestedServer:
    """An MCP server as a request names it (either dialect): `url` None names a
    registered connector by `label`; `headers` are the request's own secrets; `param`
    is the request field that named it, for refusals."""

    label: str
    url: str | None
    param: str
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    allowed: frozenset[str] | None = None
    approval: Approval = field(default_factory=Approval)
    read_only: bool = False


def _narrowed(*sets: Sequence[str] | frozenset[str] | None) -> frozenset[str] | None:
    out: frozenset[str] | None = None
    for names in sets:
        if names is not None:
            out = frozenset(names) if out is None else out & frozenset(names)
    return out


def _grant_for(record: McpServerRecord, key: KeyContext) -> McpGrant | None:
    for g in record.grants:
        if (g.subject, g.subject_id) in (("key", key.key_id), ("project", key.project_id)):
            return g
    return None


def _registered(record: McpServerRecord, want: RequestedServer,
                key: KeyContext) -> McpServer:
    grant_tools: tuple[str, ...] | None = None
    if record.grants:
        found = _grant_for(record, key)
        if found is None:
            raise APIError(403, f"This key may not call the MCP server '{record.label}'.",
                           param=want.param, code="mcp_server_not_allowed")
        grant_tools = found.tools
    approval = (Approval("always") if record.require_approval == "always"
                else want.approval)
    return McpServer(
        label=want.label, url=record.url, headers={**record.headers, **want.headers},
        allowed=_narrowed(want.allowed, record.allowed_tools, grant_tools),
        approval=approval, registered=True, description=record.description,
        read_only=want.read_only)


async def resolve(store: Store | None, key: KeyContext | None,
                  wanted: Sequence[RequestedServer]) -> list[McpServer]:
    """The servers a request's MCP tools name, with the registry's secrets and rules
    applied for the key's org (400 for an unknown label, 403 for a server the key has
    no grant on, 400 for two tools with one label)."""
    labels = [w.label for w in wanted]
    for i, label in enumerate(labels):
        if label in labels[:i]:
            raise invalid_request(f"Two MCP tools are labelled '{label}'; labels must be "
                                  "unique.", param=wanted[i].param)
    records = (await stored.servers(store.db.engine, key.org_id, secrets=True)
               if store is not None and key is not None else [])
    out = []
    for want in wanted:
        record = next((r for r in records if want.url is not None and r.url == want.url),
                      None) or next((r for r in records if want.url is None
                                     and r.label == want.label), None)
        if record is not None and key is not None:
            out.append(_registered(record, want, key))
        elif want.url is None:
            raise invalid_request(f"No MCP server is registered as '{want.label}' for this "
                                  "organization; give its URL.", param=want.param)
        else:
            out.append(McpServer(label=want.label, url=want.url, headers=want.headers,
                                 allowed=want.allowed, approval=want.approval,
                                 read_only=want.read_only))
    return out
