"""Idempotency records belong to the API key that made the request, on its route.

`idempotency_records` gains `api_key_id` (now in the primary key: org, key id,
Idempotency-Key) and `route` ("POST /v1/chat/completions"). A record used to be the org's
and route-blind: another key of the org, even one whose scopes barred the model, got the
stored response by replaying the Idempotency-Key and body, and the same bytes on another
route replayed the first route's body.

The table is made anew rather than altered: a record of before names neither its key nor
its route, so no gateway of this revision could ever replay it (they would only linger,
nothing purges them), and a primary key change rebuilds the table on SQLite anyway. The
retries of requests made before the upgrade run again instead of replaying. Both new
columns default to '' so that a gateway of before this revision, still running during a
rolling upgrade, can keep claiming keys (rows no new gateway matches).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# Frozen in time, as in 0001: the types are spelled out rather than imported.
TIMESTAMP = sa.DateTime(timezone=True)
ID = 32


def _create(per_key: bool) -> None:
    """The table of 0008 (`per_key`) or the one of 0001, with its expiry index."""
    scope = [
        sa.Column("org_id", sa.String(ID), nullable=False),
        *([sa.Column("api_key_id", sa.String(ID), nullable=False, server_default="")]
          if per_key else []),
        sa.Column("key", sa.String(255), nullable=False),
        *([sa.Column("route", sa.String(100), nullable=False, server_default="")]
          if per_key else []),
    ]
    op.create_table(
        "idempotency_records",
        *scope,
        sa.Column("body_hash", sa.String(64), nullable=False),
        sa.Column("state", sa.String(8), nullable=False),
        sa.Column("status_code", sa.Integer, nullable=True),
        sa.Column("headers", sa.JSON, nullable=True),
        sa.Column("body", sa.LargeBinary, nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("expires_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("org_id", *(["api_key_id"] if per_key else []), "key",
                                name="pk_idempotency_records"),
    )
    op.create_index("ix_idempotency_records_expires_at", "idempotency_records", ["expires_at"])


def _drop() -> None:
    op.drop_index("ix_idempotency_records_expires_at", "idempotency_records")
    op.drop_table("idempotency_records")


def upgrade() -> None:
    _drop()
    _create(per_key=True)


def downgrade() -> None:
    # 0001's primary key cannot hold two keys' records of one Idempotency-Key: the
    # records go, as they went on the way up.
    _drop()
    _create(per_key=False)
