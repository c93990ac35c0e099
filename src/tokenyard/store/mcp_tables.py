"""The MCP registry's tables (issue 41): the servers an org's admin registered, and
which keys or projects may call which of their tools. Declared on `tables.metadata`
beside the other tables (migration 0014 creates them; the package imports this module,
so the schema is whole wherever the store is used)."""

from __future__ import annotations

from sqlalchemy import JSON, Column, PrimaryKeyConstraint, String, Table, Text, UniqueConstraint

from tokenyard.store.tables import ID, UTCDateTime, metadata

#: The longest MCP server URL the registry keeps.
URL_CHARS = 2048

mcp_servers = Table(
    "mcp_servers",
    metadata,
    # One row per server an admin registered for an org: the label requests name it by
    # (unique in the org), its URL, the headers every call to it carries (its secrets:
    # never returned, logged or recorded), the tools it offers at most (NULL: all) and
    # its approval rule ("always", "never"; NULL: the request's own).
    Column("id", String(ID), primary_key=True),
    Column("org_id", String(ID), nullable=False, index=True),
    Column("label", String(64), nullable=False),
    Column("url", Text, nullable=False),
    Column("headers", JSON, nullable=False),
    Column("allowed_tools", JSON, nullable=True),
    Column("require_approval", String(8), nullable=True),
    Column("description", Text, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    UniqueConstraint("org_id", "label"),
)

mcp_grants = Table(
    "mcp_grants",
    metadata,
    # Who may call a registered server: a key or a project, and which of its tools (NULL:
    # every tool the server offers). A server without grants is open to every key of its
    # org; with grants, only to the keys they name (directly or by project).
    Column("server_id", String(ID), nullable=False),
    Column("subject", String(8), nullable=False),  # "key" or "project"
    Column("subject_id", String(ID), nullable=False),
    Column("tools", JSON, nullable=True),
    PrimaryKeyConstraint("server_id", "subject", "subject_id"),
)
