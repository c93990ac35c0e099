"""What admins credited to a prepaid balance, apart from what the ledger debited (issue 40).

`balances.credited_micros`: the sum of every `add_credit` (credits and admin debits);
`balances.credit_seq`: how many there were. Gateways that hold money in Redis seed an
org's balance once and then count its spend there; these two columns tell them, exactly
and in order, what credit was added since (`gateway/redis_money.py`).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ALTER TABLE (as 0010, 0012): only adds columns with a default.
    op.add_column("balances", sa.Column("credited_micros", sa.BigInteger, nullable=False,
                                        server_default="0"))
    op.add_column("balances", sa.Column("credit_seq", sa.BigInteger, nullable=False,
                                        server_default="0"))


def downgrade() -> None:
    op.drop_column("balances", "credit_seq")
    op.drop_column("balances", "credited_micros")
