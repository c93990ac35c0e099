"""Request records and body capture.

`request_records`: one row per finished request that reached a deployment (timeline,
tokens, deployment, replica, status, finish reason, cost), purged after the serve's
retention window.
`org_capture`: the orgs whose bodies are captured (no row: off) and for how many days;
`request_captures`: those redacted bodies, purged at `expires_at`.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# Frozen in time, as in 0001: the types are spelled out rather than imported.
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "request_records",
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("org_id", sa.String(32), nullable=True),
        sa.Column("project_id", sa.String(32), nullable=True),
        sa.Column("key_prefix", sa.String(16), nullable=True),
        sa.Column("endpoint", sa.String(100), nullable=False),
        sa.Column("model", sa.String(200), nullable=True),
        sa.Column("deployment", sa.String(200), nullable=True),
        sa.Column("replica", sa.String(200), nullable=True),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("finish_reason", sa.String(200), nullable=True),
        sa.Column("stream", sa.Boolean, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("cached_tokens", sa.Integer, nullable=False),
        sa.Column("output_tokens", sa.Integer, nullable=False),
        sa.Column("cost_micros", sa.BigInteger, nullable=True),
        sa.Column("timings", sa.JSON, nullable=False),
        sa.Column("duration_ms", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("request_id", name="pk_request_records"),
    )
    op.create_index("ix_request_records_created_at", "request_records", ["created_at"])
    op.create_table(
        "org_capture",
        sa.Column("org_id", sa.String(32), nullable=False),
        sa.Column("retention_days", sa.Integer, nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name="fk_org_capture_org_id_orgs"),
        sa.PrimaryKeyConstraint("org_id", name="pk_org_capture"),
    )
    op.create_table(
        "request_captures",
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("org_id", sa.String(32), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("expires_at", TIMESTAMP, nullable=False),
        sa.Column("request", sa.Text, nullable=False),
        sa.Column("response", sa.Text, nullable=True),
        sa.Column("truncated", sa.Boolean, nullable=False),
        sa.PrimaryKeyConstraint("request_id", name="pk_request_captures"),
    )
    op.create_index("ix_request_captures_expires_at", "request_captures", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_request_captures_expires_at", "request_captures")
    op.drop_table("request_captures")
    op.drop_table("org_capture")
    op.drop_index("ix_request_records_created_at", "request_records")
    op.drop_table("request_records")
