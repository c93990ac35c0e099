"""Shadow results: one row per request an alias copied to its shadow deployment.

The copy is never billed and its answer is thrown away; what is kept is the comparison
that `tokenyard admin shadow report` aggregates: both deployments' latencies (ms, from the
request's start to its last token), their output tokens and whether the texts matched.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# Frozen in time, as in 0001: the types are spelled out rather than imported.
TIMESTAMP = sa.DateTime(timezone=True)
ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "shadow_results",
        sa.Column("id", ROW_ID, nullable=False, autoincrement=True),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("alias", sa.String(200), nullable=False),
        sa.Column("primary_deployment", sa.String(200), nullable=False),
        sa.Column("shadow_deployment", sa.String(200), nullable=False),
        sa.Column("primary_ms", sa.Float, nullable=False),
        sa.Column("shadow_ms", sa.Float, nullable=False),
        sa.Column("primary_output_tokens", sa.Integer, nullable=False),
        sa.Column("shadow_output_tokens", sa.Integer, nullable=False),
        sa.Column("texts_match", sa.Boolean, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_shadow_results"),
    )
    op.create_index("ix_shadow_results_alias_created_at", "shadow_results",
                    ["alias", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_shadow_results_alias_created_at", "shadow_results")
    op.drop_table("shadow_results")
