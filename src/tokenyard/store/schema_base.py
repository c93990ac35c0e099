"""What every table of the schema shares: the metadata, the UTC timestamp type, id
lengths and the column groups several tables repeat (tables.py, batch_tables.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Dialect,
    Integer,
    MetaData,
    TypeDecorator,
)


class UTCDateTime(TypeDecorator[datetime]):
    """An aware UTC datetime in Python on every backend.

    PostgreSQL keeps the zone (timestamptz); SQLite stores text without one, so values are
    converted to UTC and made naive on the way in and marked UTC on the way out.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware UTC datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# SQLite only autoincrements an `INTEGER PRIMARY KEY` (the rowid alias), not BIGINT.
LedgerId = BigInteger().with_variant(Integer(), "sqlite")

ID = 32  # length of id columns: "proj_" + 16 random chars fits with room to spare

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


def limit_columns() -> list[Column[Any]]:
    """Rate-limit columns shared by orgs and keys; NULL means unlimited."""
    return [
        Column("rpm", Integer, nullable=True),  # requests per minute
        Column("tpm", Integer, nullable=True),  # tokens per minute
        Column("max_concurrency", Integer, nullable=True),  # requests in flight
    ]


def budget_columns() -> list[Column[Any]]:
    """Spend budgets of keys and users (0009), in micros; NULL means none."""
    return [
        Column("monthly_budget_micros", BigInteger, nullable=True),  # per UTC calendar month
        Column("total_budget_micros", BigInteger, nullable=True),  # all time
    ]
