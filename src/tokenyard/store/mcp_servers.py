"""The MCP registry in the store: servers registered per org and their grants
(`mcp_tables.py`). A server's `headers` are its secrets: they are read only by
`servers_for` (what a request's calls need) and never by the admin listing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from tokenyard.store.mcp_tables import mcp_grants, mcp_servers


@dataclass(frozen=True)
class McpGrant:
    """A key or project that may call a server's `tools` (None: every one it offers)."""

    subject: str  # "key" or "project"
    subject_id: str
    tools: tuple[str, ...] | None


@dataclass(frozen=True)
class McpServerRecord:
    """A registered server. `headers` holds its secrets (empty when read for a listing)."""

    id: str
    org_id: str
    label: str
    url: str
    headers: dict[str, str]
    allowed_tools: tuple[str, ...] | None
    require_approval: str | None
    description: str | None
    created_at: datetime
    header_names: tuple[str, ...] = ()
    grants: tuple[McpGrant, ...] = ()


def _names(value: Any) -> tuple[str, ...] | None:
    return None if value is None else tuple(str(v) for v in value)


def _record(row: Any, grants: Sequence[McpGrant], secrets: bool) -> McpServerRecord:
    headers = {str(k): str(v) for k, v in (row["headers"] or {}).items()}
    return McpServerRecord(
        id=row["id"], org_id=row["org_id"], label=row["label"], url=row["url"],
        headers=headers if secrets else {}, allowed_tools=_names(row["allowed_tools"]),
        require_approval=row["require_approval"], description=row["description"],
        created_at=row["created_at"], header_names=tuple(sorted(headers)),
        grants=tuple(grants))


async def insert_server(engine: AsyncEngine, record: McpServerRecord) -> bool:
    """Register `record`; False when its org already has a server of that label."""
    row = {name: getattr(record, name) for name in (
        "id", "org_id", "label", "url", "headers", "require_approval", "description",
        "created_at")}
    row["allowed_tools"] = None if record.allowed_tools is None else list(record.allowed_tools)
    try:
        async with engine.begin() as conn:
            await conn.execute(insert(mcp_servers), [row])
    except IntegrityError:
        return False
    return True


async def delete_server(engine: AsyncEngine, server_id: str) -> bool:
    """Remove a server and its grants; False if there is none of that id."""
    async with engine.begin() as conn:
        await conn.execute(delete(mcp_grants).where(mcp_grants.c.server_id == server_id))
        result = await conn.execute(delete(mcp_servers).where(mcp_servers.c.id == server_id))
    return result.rowcount == 1


async def set_grant(engine: AsyncEngine, server_id: str, grant: McpGrant) -> bool:
    """Replace the grant of `grant`'s subject on the server; False if no such server."""
    async with engine.begin() as conn:
        found = (await conn.execute(select(mcp_servers.c.id).where(
            mcp_servers.c.id == server_id))).first()
        if found is None:
            return False
        t = mcp_grants
        await conn.execute(delete(t).where(
            (t.c.server_id == server_id) & (t.c.subject == grant.subject)
            & (t.c.subject_id == grant.subject_id)))
        await conn.execute(insert(t), [{
            "server_id": server_id, "subject": grant.subject, "subject_id": grant.subject_id,
            "tools": None if grant.tools is None else list(grant.tools)}])
    return True


async def servers(engine: AsyncEngine, org_id: str | None, *, secrets: bool = False,
                  server_id: str | None = None) -> list[McpServerRecord]:
    """The servers of `org_id` (None: every org), with their grants, by label; their
    headers' values only with `secrets` (what a request's calls need)."""
    query = select(mcp_servers).order_by(mcp_servers.c.org_id, mcp_servers.c.label)
    if org_id is not None:
        query = query.where(mcp_servers.c.org_id == org_id)
    if server_id is not None:
        query = query.where(mcp_servers.c.id == server_id)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).mappings().all()
        ids = [row["id"] for row in rows]
        grant_rows = (await conn.execute(select(mcp_grants).where(
            mcp_grants.c.server_id.in_(ids)))).mappings().all() if ids else []
    grants: dict[str, list[McpGrant]] = {}
    for g in grant_rows:
        grants.setdefault(g["server_id"], []).append(
            McpGrant(g["subject"], g["subject_id"], _names(g["tools"])))
    return [_record(row, grants.get(row["id"], ()), secrets) for row in rows]
