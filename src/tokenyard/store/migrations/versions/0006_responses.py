"""Stored responses: what `POST /v1/responses` kept for later turns and lookups.

One row per stored response: its id, the org (and project, key) it belongs to, the
response it continued, the response object as the client received it, the input items
of its own turn, and when it stops being served (`expires_at`, purged in the background).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# Frozen in time, as in 0001: the types are spelled out rather than imported.
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(100), nullable=False),
        sa.Column("org_id", sa.String(32), nullable=False),
        sa.Column("project_id", sa.String(32), nullable=True),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("previous_response_id", sa.String(100), nullable=True),
        sa.Column("response", sa.JSON, nullable=False),
        sa.Column("input_items", sa.JSON, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("expires_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_stored_responses"),
    )
    op.create_index("ix_stored_responses_expires_at", "stored_responses", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_stored_responses_expires_at", "stored_responses")
    op.drop_table("stored_responses")
