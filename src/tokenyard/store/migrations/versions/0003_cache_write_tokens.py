"""Prompt-cache writes in the ledger: tokens written for 5 minutes and for 1 hour.

Anthropic's `cache_control` breakpoints pin prompt prefixes in the engine; the tokens a
request wrote that way are priced as cache writes (1.25× the input price for 5 minutes,
2× for 1 hour) and counted in `usage_ledger.cache_write_5m_tokens` and
`cache_write_1h_tokens` (NOT NULL, 0 for every earlier row). No price column: a write's
price follows from the model's input price.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

COLUMNS = ("cache_write_5m_tokens", "cache_write_1h_tokens")


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column(
            "usage_ledger", sa.Column(name, sa.Integer, nullable=False, server_default="0")
        )


def downgrade() -> None:
    # Plain ALTER TABLE … DROP COLUMN, as in 0002 (no batch rebuild).
    for name in reversed(COLUMNS):
        op.drop_column("usage_ledger", name)
