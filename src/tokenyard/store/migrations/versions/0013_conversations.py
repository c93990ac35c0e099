"""Conversations (issue 41): the Conversations API's conversations and their items.

One row per conversation: its id, the org (and project, key) it belongs to, its
metadata, its items in order (JSON), its revision (bumped by each change, which
writes only over the revision it read), and when it was created.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# Frozen in time, as in 0001: the types are spelled out rather than imported.
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(100), nullable=False),
        sa.Column("org_id", sa.String(32), nullable=False),
        sa.Column("project_id", sa.String(32), nullable=True),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("metadata", sa.JSON, nullable=False),
        sa.Column("items", sa.JSON, nullable=False),
        sa.Column("revision", sa.Integer, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_conversations"),
    )
    op.create_index("ix_conversations_org_id", "conversations", ["org_id"])


def downgrade() -> None:
    op.drop_index("ix_conversations_org_id", "conversations")
    op.drop_table("conversations")
