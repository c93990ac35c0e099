"""Regions: allowed regions of orgs and projects; the serving region on records (issue 28).

`orgs.allowed_regions` and `projects.allowed_regions` hold a JSON list of region names
(NULL: any region; a project's list narrows its org's). `usage_ledger.region` and
`request_records.region` name the region of the deployment that served the request (NULL:
a deployment that declares none), so usage reports can group by it.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

#: Long enough for any region name the admin API accepts (`store/regions.py`).
REGION = 64
_LISTS = ("orgs", "projects")
_SERVED = ("usage_ledger", "request_records")


def upgrade() -> None:
    # Plain ALTER TABLE (as 0002): batch mode would rebuild the tables, and rebuilding one
    # that foreign keys point at (orgs, projects) fails with them on.
    for table in _LISTS:
        op.add_column(table, sa.Column("allowed_regions", sa.JSON, nullable=True))
    for table in _SERVED:
        op.add_column(table, sa.Column("region", sa.String(REGION), nullable=True))


def downgrade() -> None:
    for table in _SERVED:
        op.drop_column(table, "region")
    for table in _LISTS:
        op.drop_column(table, "allowed_regions")
