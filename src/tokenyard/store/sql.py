"""Small SQL helpers shared by the repository and the ledger writer."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite


def utcnow() -> datetime:
    """The current time as an aware UTC datetime."""
    return datetime.now(UTC)


def insert_for(dialect: str, table: Table) -> postgresql.Insert | sqlite.Insert:
    """An INSERT with `on_conflict_do_*` for `dialect`; both backends share that API."""
    module = postgresql if dialect == "postgresql" else sqlite
    return module.insert(table)
