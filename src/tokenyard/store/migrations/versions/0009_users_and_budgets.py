"""Users of an org, keys tied to them, and per-key and per-user spend budgets (issue 29).

- `users` gains `name`, `project_id` (the project the user works in, NULL: none; its
  keys default to it) and an email unique within its org. `project_id` has no foreign key:
  adding one on SQLite would rebuild `users`, which `api_keys` points at (the store checks
  that the project is the user's org's).
- `api_keys` and `users` gain `monthly_budget_micros` (per UTC calendar month) and
  `total_budget_micros` (all time): spend budgets checked at admission (NULL: none).
- `usage_ledger.user_id` and `request_records.user_id`: the user of the key that made
  the request (NULL: a key of no user), so usage reports group by user. The ledger is
  indexed by (key_id, day) and (user_id, day), what a budget's spend is read by.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

ID = 32
_BUDGETED = ("api_keys", "users")
_BUDGETS = ("monthly_budget_micros", "total_budget_micros")
_ATTRIBUTED = ("usage_ledger", "request_records")
#: (index, table, columns) created here.
_INDEXES = (
    ("ix_users_org_id_email", "users", ["org_id", "email"]),
    ("ix_usage_ledger_key_id_day", "usage_ledger", ["key_id", "day"]),
    ("ix_usage_ledger_user_id_day", "usage_ledger", ["user_id", "day"]),
)


def upgrade() -> None:
    # Plain ALTER TABLE (as 0002): batch mode would rebuild the tables, and rebuilding one
    # that foreign keys point at (users, api_keys' parents) fails with them on.
    op.add_column("users", sa.Column("name", sa.String(200), nullable=True))
    op.add_column("users", sa.Column("project_id", sa.String(ID), nullable=True))
    for table in _BUDGETED:
        for column in _BUDGETS:
            op.add_column(table, sa.Column(column, sa.BigInteger, nullable=True))
    for table in _ATTRIBUTED:
        op.add_column(table, sa.Column("user_id", sa.String(ID), nullable=True))
    for name, table, columns in _INDEXES:
        op.create_index(name, table, columns, unique=table == "users")


def downgrade() -> None:
    for name, table, _ in _INDEXES:
        op.drop_index(name, table)
    for table in _ATTRIBUTED:
        op.drop_column(table, "user_id")
    for table in _BUDGETED:
        for column in _BUDGETS:
            op.drop_column(table, column)
    op.drop_column("users", "project_id")
    op.drop_column("users", "name")
