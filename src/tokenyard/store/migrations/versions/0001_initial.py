"""Initial schema: orgs, projects, users, api_keys, prices, balances, caps, ledger, idempotency.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ID = 32
# Migrations are frozen in time, so they spell their types out rather than import tables.py.
TIMESTAMP = sa.DateTime(timezone=True)
LEDGER_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _limits() -> list[sa.Column]:
    return [
        sa.Column("rpm", sa.Integer, nullable=True),
        sa.Column("tpm", sa.Integer, nullable=True),
        sa.Column("max_concurrency", sa.Integer, nullable=True),
    ]


def upgrade() -> None:
    op.create_table(
        "orgs",
        sa.Column("id", sa.String(ID), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        *_limits(),
        sa.Column("free_tier_daily_requests", sa.Integer, nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_orgs"),
    )
    op.create_table(
        "projects",
        sa.Column("id", sa.String(ID), nullable=False),
        sa.Column("org_id", sa.String(ID), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_projects"),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name="fk_projects_org_id_orgs"),
    )
    op.create_index("ix_projects_org_id", "projects", ["org_id"])
    op.create_table(
        "users",
        sa.Column("id", sa.String(ID), nullable=False),
        sa.Column("org_id", sa.String(ID), nullable=False),
        sa.Column("email", sa.String(320), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_users"),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name="fk_users_org_id_orgs"),
    )
    op.create_index("ix_users_org_id", "users", ["org_id"])
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(ID), nullable=False),
        sa.Column("org_id", sa.String(ID), nullable=False),
        sa.Column("project_id", sa.String(ID), nullable=True),
        sa.Column("user_id", sa.String(ID), nullable=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("scopes", sa.JSON, nullable=False),
        *_limits(),
        sa.Column("expires_at", TIMESTAMP, nullable=True),
        sa.Column("revoked_at", TIMESTAMP, nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name="fk_api_keys_org_id_orgs"),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name="fk_api_keys_project_id_projects"
        ),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], name="fk_api_keys_user_id_users"),
        sa.UniqueConstraint("secret_hash", name="uq_api_keys_secret_hash"),
    )
    op.create_index("ix_api_keys_org_id", "api_keys", ["org_id"])
    op.create_table(
        "model_prices",
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("input", sa.BigInteger, nullable=False),
        sa.Column("cached_input", sa.BigInteger, nullable=False),
        sa.Column("cache_write", sa.BigInteger, nullable=False),
        sa.Column("output", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("model", name="pk_model_prices"),
    )
    op.create_table(
        "balances",
        sa.Column("org_id", sa.String(ID), nullable=False),
        sa.Column("balance_micros", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("org_id", name="pk_balances"),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name="fk_balances_org_id_orgs"),
    )
    op.create_table(
        "spend_caps",
        sa.Column("id", sa.String(ID), nullable=False),
        sa.Column("org_id", sa.String(ID), nullable=False),
        sa.Column("project_id", sa.String(ID), nullable=True),
        sa.Column("cap_micros", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_spend_caps"),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"], name="fk_spend_caps_org_id_orgs"),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name="fk_spend_caps_project_id_projects"
        ),
    )
    op.create_index("ix_spend_caps_org_id_project_id", "spend_caps", ["org_id", "project_id"])
    op.create_table(
        "usage_ledger",
        sa.Column("id", LEDGER_ID, nullable=False, autoincrement=True),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("day", sa.String(10), nullable=False),
        sa.Column("org_id", sa.String(ID), nullable=False),
        sa.Column("project_id", sa.String(ID), nullable=True),
        sa.Column("key_id", sa.String(ID), nullable=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("endpoint", sa.String(100), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("cached_tokens", sa.Integer, nullable=False),
        sa.Column("cache_write_tokens", sa.Integer, nullable=False),
        sa.Column("output_tokens", sa.Integer, nullable=False),
        sa.Column("cost_micros", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_usage_ledger"),
        sa.UniqueConstraint("request_id", name="uq_usage_ledger_request_id"),
    )
    op.create_index("ix_usage_ledger_created_at", "usage_ledger", ["created_at"])
    op.create_index("ix_usage_ledger_org_id_day", "usage_ledger", ["org_id", "day"])
    op.create_table(
        "idempotency_records",
        sa.Column("org_id", sa.String(ID), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("body_hash", sa.String(64), nullable=False),
        sa.Column("state", sa.String(8), nullable=False),
        sa.Column("status_code", sa.Integer, nullable=True),
        sa.Column("headers", sa.JSON, nullable=True),
        sa.Column("body", sa.LargeBinary, nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("expires_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("org_id", "key", name="pk_idempotency_records"),
    )
    op.create_index("ix_idempotency_records_expires_at", "idempotency_records", ["expires_at"])


def downgrade() -> None:
    # Reverse order of creation, so no foreign key points at a dropped table.
    for table in (
        "idempotency_records",
        "usage_ledger",
        "spend_caps",
        "balances",
        "model_prices",
        "api_keys",
        "users",
        "projects",
        "orgs",
    ):
        op.drop_table(table)
