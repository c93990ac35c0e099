"""An org's own enqueued-token quota for the Batch API (issue 23).

`orgs.batch_enqueued_tokens`: the estimated tokens the org's batches at work may hold
(NULL: the gateway's default, `TOKENYARD_BATCH_ENQUEUED_TOKENS`). Set with the org's
other limits (`POST /admin/v1/orgs/{org_id}/limits`).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ALTER TABLE (as 0010): rebuilding orgs, which foreign keys point at, fails.
    op.add_column("orgs", sa.Column("batch_enqueued_tokens", sa.BigInteger, nullable=True))


def downgrade() -> None:
    op.drop_column("orgs", "batch_enqueued_tokens")
