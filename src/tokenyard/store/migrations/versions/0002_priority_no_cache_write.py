"""Priority classes on orgs and keys; the cache-write price and token count removed.

- `orgs.priority` (NOT NULL, default 0: normal) and `api_keys.priority` (NULL: the org's):
  the engine scheduler's class for their requests, lower first.
- `model_prices.cache_write` and `usage_ledger.cache_write_tokens` are dropped: nothing
  writes an explicit prompt cache, so nothing was ever charged or counted there (the
  ledger column held only zeros). They come back with the prompt cache that uses them.

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "orgs", sa.Column("priority", sa.Integer, nullable=False, server_default="0")
    )
    op.add_column("api_keys", sa.Column("priority", sa.Integer, nullable=True))
    # Plain ALTER TABLE … DROP COLUMN (SQLite >= 3.35 has it): batch mode would rebuild
    # the table, and rebuilding one that foreign keys point at (orgs) fails with them on.
    op.drop_column("model_prices", "cache_write")
    op.drop_column("usage_ledger", "cache_write_tokens")


def downgrade() -> None:
    op.add_column(
        "usage_ledger",
        sa.Column("cache_write_tokens", sa.Integer, nullable=False, server_default="0"),
    )
    op.add_column(
        "model_prices",
        sa.Column("cache_write", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.drop_column("api_keys", "priority")
    op.drop_column("orgs", "priority")
