"""Background responses (issue 41): `background: true` on POST /v1/responses.

`background_responses`: one row per background response, claimed by a gateway's worker
under a lease (as batch lines are) and holding the response object as it stands.
`background_events`: its stream events in order, for streaming and resuming it.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

# Frozen in time, as in 0001: the types are spelled out rather than imported.
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "background_responses",
        sa.Column("id", sa.String(100), nullable=False),
        sa.Column("org_id", sa.String(32), nullable=False),
        sa.Column("project_id", sa.String(32), nullable=True),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("region", sa.String(64), nullable=True),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("earlier", sa.JSON, nullable=False),
        sa.Column("response", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("claimed_by", sa.String(64), nullable=True),
        sa.Column("lease_until", TIMESTAMP, nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("ended_at", TIMESTAMP, nullable=True),
        sa.Column("expires_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_background_responses"),
    )
    op.create_index("ix_background_responses_expires_at", "background_responses",
                    ["expires_at"])
    op.create_index("ix_background_responses_state_created_at", "background_responses",
                    ["state", "created_at"])
    op.create_table(
        "background_events",
        sa.Column("response_id", sa.String(100), nullable=False),
        sa.Column("sequence", sa.Integer, nullable=False),
        sa.Column("event", sa.JSON, nullable=False),
        sa.PrimaryKeyConstraint("response_id", "sequence", name="pk_background_events"),
    )


def downgrade() -> None:
    op.drop_table("background_events")
    op.drop_index("ix_background_responses_state_created_at", "background_responses")
    op.drop_index("ix_background_responses_expires_at", "background_responses")
    op.drop_table("background_responses")
