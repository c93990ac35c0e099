"""Moderation: an org's policy per direction, and the audit trail of flagged texts.

`org_moderation` holds an org's input and output policy ('off', 'flag' or 'block'; no
row: off), which the gateway combines with the deployment's (the stricter wins).
`moderation_events` records every flagged or blocked text (written off the request path):
request, org, deployment, direction, action, classifier, flagged categories and scores.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# Frozen in time, as in 0001: the types are spelled out rather than imported.
TIMESTAMP = sa.DateTime(timezone=True)
ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "org_moderation",
        sa.Column("org_id", sa.String(32), nullable=False),
        sa.Column("input", sa.String(8), nullable=False),
        sa.Column("output", sa.String(8), nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"],
                                name="fk_org_moderation_org_id_orgs"),
        sa.PrimaryKeyConstraint("org_id", name="pk_org_moderation"),
    )
    op.create_table(
        "moderation_events",
        sa.Column("id", ROW_ID, nullable=False, autoincrement=True),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("org_id", sa.String(32), nullable=True),
        sa.Column("deployment", sa.String(200), nullable=False),
        sa.Column("direction", sa.String(8), nullable=False),
        sa.Column("action", sa.String(8), nullable=False),
        sa.Column("classifier", sa.String(32), nullable=False),
        sa.Column("categories", sa.JSON, nullable=False),
        sa.Column("scores", sa.JSON, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_moderation_events"),
    )
    op.create_index("ix_moderation_events_org_id_created_at", "moderation_events",
                    ["org_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_moderation_events_org_id_created_at", "moderation_events")
    op.drop_table("moderation_events")
    op.drop_table("org_moderation")
