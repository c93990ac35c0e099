"""The MCP registry (issue 41): servers registered per org, and their grants.

`mcp_servers`: one row per registered server (label unique in its org, URL, secret
headers, allowed tools, approval rule). `mcp_grants`: which keys or projects may call
which of a server's tools.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

# Frozen in time, as in 0001: the types are spelled out rather than imported.
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "mcp_servers",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("org_id", sa.String(32), nullable=False),
        sa.Column("label", sa.String(64), nullable=False),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("headers", sa.JSON, nullable=False),
        sa.Column("allowed_tools", sa.JSON, nullable=True),
        sa.Column("require_approval", sa.String(8), nullable=True),
        sa.Column("description", sa.Text, nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_mcp_servers"),
        sa.UniqueConstraint("org_id", "label", name="uq_mcp_servers_org_id_label"),
    )
    op.create_index("ix_mcp_servers_org_id", "mcp_servers", ["org_id"])
    op.create_table(
        "mcp_grants",
        sa.Column("server_id", sa.String(32), nullable=False),
        sa.Column("subject", sa.String(8), nullable=False),
        sa.Column("subject_id", sa.String(32), nullable=False),
        sa.Column("tools", sa.JSON, nullable=True),
        sa.PrimaryKeyConstraint("server_id", "subject", "subject_id", name="pk_mcp_grants"),
    )


def downgrade() -> None:
    op.drop_table("mcp_grants")
    op.drop_index("ix_mcp_servers_org_id", "mcp_servers")
    op.drop_table("mcp_servers")
