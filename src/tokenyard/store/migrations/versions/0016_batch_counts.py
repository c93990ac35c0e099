"""A batch's counts and usage kept on its row as its lines end (issue 38).

`batches.succeeded`, `failed`, `cancelled`: lines ended so far, by how (cancelled: cut in
flight by the batch's cancel); `input_tokens`, `cached_tokens`, `output_tokens`: what its
lines used (billed); `model`: the model its lines name. A status read then costs one
row, not a count of the lines. Rows of batches from before are filled from their lines.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

COUNTS = ("succeeded", "failed", "cancelled", "input_tokens", "cached_tokens",
          "output_tokens")


def upgrade() -> None:
    # Plain ALTER TABLE (as 0010): no rebuild of a table that may be large.
    op.add_column("batches", sa.Column("model", sa.String(255), nullable=True))
    for name in COUNTS:
        kind = sa.Integer if name in ("succeeded", "failed", "cancelled") else sa.BigInteger
        op.add_column("batches", sa.Column(name, kind, nullable=False, server_default="0"))
    op.execute(
        "UPDATE batches SET "
        "succeeded = (SELECT COUNT(*) FROM batch_lines l WHERE l.batch_id = batches.id "
        "AND l.state = 'done' AND l.status_code = 200), "
        "failed = (SELECT COUNT(*) FROM batch_lines l WHERE l.batch_id = batches.id "
        "AND l.state = 'done' AND (l.status_code IS NULL OR l.status_code <> 200))")


def downgrade() -> None:
    for name in reversed(COUNTS):
        op.drop_column("batches", name)
    op.drop_column("batches", "model")
