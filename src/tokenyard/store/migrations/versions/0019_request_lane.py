"""The lane of a request record (issue 38): `request_records.lane` says where a request
came from: `live` (a client waited on it), `batch` (a Batch API line) or `background` (a
background response). NOT NULL; the rows written before it were live requests and batch
lines alike, and read as `live` (the column's default).

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ALTER TABLE (as 0002 and 0015): with a server default, SQLite and PostgreSQL
    # both add a NOT NULL column without rebuilding the table.
    op.add_column("request_records", sa.Column(
        "lane", sa.String(16), nullable=False, server_default="live"))
    op.create_index("ix_request_records_lane_created_at", "request_records",
                    ["lane", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_request_records_lane_created_at", "request_records")
    op.drop_column("request_records", "lane")
