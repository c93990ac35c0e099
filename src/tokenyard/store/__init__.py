"""The gateway's state (DESIGN §4): one schema and one set of migrations for SQLite and
PostgreSQL, a `Store` of async methods returning frozen records, and the usage ledger
writer that keeps settled usage off the request path without losing it in a crash."""

from tokenyard.store import background_tables as background_tables  # its tables join the schema
from tokenyard.store import mcp_tables as mcp_tables  # its tables join the schema
from tokenyard.store.db import Database, normalize_url
from tokenyard.store.ledger import LedgerWriter, UsageRecord
from tokenyard.store.money import Prices, cost_micros, format_money, parse_money
from tokenyard.store.records import (
    ApiKeyRecord,
    IdempotencyRecord,
    KeyContext,
    Limits,
    OrgRecord,
    ProjectRecord,
    Scopes,
    SpendCap,
    UsageRow,
    UserRecord,
)
from tokenyard.store.repo import Store

__all__ = [
    "ApiKeyRecord",
    "Database",
    "IdempotencyRecord",
    "KeyContext",
    "LedgerWriter",
    "Limits",
    "OrgRecord",
    "Prices",
    "ProjectRecord",
    "Scopes",
    "SpendCap",
    "Store",
    "UsageRecord",
    "UsageRow",
    "UserRecord",
    "cost_micros",
    "format_money",
    "normalize_url",
    "parse_money",
]
