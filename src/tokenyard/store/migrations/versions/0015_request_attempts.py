"""Fallbacks (issue 41): the attempts of a request record.

`request_records.attempts` holds, for a request that had fallbacks, each candidate it
tried in order as a JSON list of {model, deployment, outcome, error_code} (NULL: a
request without fallbacks).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ALTER TABLE (as 0002 and 0010): a nullable column needs no table rebuild.
    op.add_column("request_records", sa.Column("attempts", sa.JSON, nullable=True))


def downgrade() -> None:
    op.drop_column("request_records", "attempts")
