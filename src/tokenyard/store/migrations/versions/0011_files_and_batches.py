"""Files and batches of the Batch API, and the batch id on ledger rows (issue 23).

`files`: what `POST /v1/files` took (and the output and error files of finished batches),
per org, with their bytes. `batches`: one row per batch (OpenAI's or Anthropic's), its
owner key, status and timestamps. `batch_lines`: one row per request of a batch, claimed
by a gateway's batch worker under a lease and holding its result once done.
`usage_ledger.batch_id`: the batch a ledger row was billed for (NULL: a live request).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# Frozen in time, as in 0001: the types are spelled out rather than imported.
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("org_id", sa.String(32), nullable=False),
        sa.Column("project_id", sa.String(32), nullable=True),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("lines", sa.Integer, nullable=False),
        sa.Column("content", sa.LargeBinary, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
    )
    op.create_index("ix_files_org_id_created_at", "files", ["org_id", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("dialect", sa.String(16), nullable=False),
        sa.Column("org_id", sa.String(32), nullable=False),
        sa.Column("project_id", sa.String(32), nullable=True),
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("endpoint", sa.String(100), nullable=False),
        sa.Column("input_file_id", sa.String(40), nullable=True),
        sa.Column("completion_window", sa.String(8), nullable=False),
        sa.Column("metadata", sa.JSON, nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("total", sa.Integer, nullable=False),
        sa.Column("enqueued_tokens", sa.BigInteger, nullable=False),
        sa.Column("output_file_id", sa.String(40), nullable=True),
        sa.Column("error_file_id", sa.String(40), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("in_progress_at", TIMESTAMP, nullable=True),
        sa.Column("expires_at", TIMESTAMP, nullable=False),
        sa.Column("cancelling_at", TIMESTAMP, nullable=True),
        sa.Column("ended_at", TIMESTAMP, nullable=True),
        sa.Column("deleted", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.PrimaryKeyConstraint("id", name="pk_batches"),
    )
    op.create_index("ix_batches_org_id_created_at", "batches", ["org_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(40), nullable=False),
        sa.Column("line", sa.Integer, nullable=False),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("sort_key", sa.String(64), nullable=False),
        sa.Column("state", sa.String(8), nullable=False),
        sa.Column("claimed_by", sa.String(64), nullable=True),
        sa.Column("lease_until", TIMESTAMP, nullable=True),
        sa.Column("status_code", sa.Integer, nullable=True),
        sa.Column("result", sa.Text, nullable=True),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.PrimaryKeyConstraint("batch_id", "line", name="pk_batch_lines"),
    )
    op.create_index("ix_batch_lines_batch_id_state_sort_key", "batch_lines",
                    ["batch_id", "state", "sort_key"])
    op.add_column("usage_ledger", sa.Column("batch_id", sa.String(40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_ledger") as table:
        table.drop_column("batch_id")
    op.drop_index("ix_batch_lines_batch_id_state_sort_key", "batch_lines")
    op.drop_table("batch_lines")
    op.drop_index("ix_batches_status", "batches")
    op.drop_index("ix_batches_org_id_created_at", "batches")
    op.drop_table("batches")
    op.drop_index("ix_files_org_id_created_at", "files")
    op.drop_table("files")
