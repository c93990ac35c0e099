"""Opening the database: URL normalisation, SQLite pragmas, migrations, engine and sessions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    create_async_engine,
)

from tokenyard.store import migrate

SQLITE_BUSY_TIMEOUT_MS = 5000  # writers queue for the lock instead of failing at once


def normalize_url(url: str) -> str:
    """The async-driver form of a database URL.

    `postgresql://` and `postgres://` -> `postgresql+asyncpg://`,
    `sqlite:///x` -> `sqlite+aiosqlite:///x`; URLs naming a driver are returned unchanged.
    """
    for plain, driver in (
        ("postgresql://", "postgresql+asyncpg://"),
        ("postgres://", "postgresql+asyncpg://"),
        ("sqlite://", "sqlite+aiosqlite://"),
    ):
        if url.startswith(plain):
            return driver + url[len(plain) :]
    return url


class Database:
    """An open database: the AsyncEngine every query of the store runs on (SQLAlchemy
    Core, no ORM sessions)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    @property
    def dialect(self) -> str:
        """'sqlite' or 'postgresql'."""
        return self.engine.dialect.name

    @classmethod
    async def open(cls, url: str, *, upgrade: bool = True) -> Database:
        """Open `url` (`ServeConfig.database`), migrating it to head unless told not to.

        For SQLite the file's parent directory is created and every connection gets WAL
        (readers never block the writer), synchronous=NORMAL and a busy timeout.
        """
        url = normalize_url(url)
        parsed = make_url(url)
        options: dict[str, Any] = {}
        if parsed.get_backend_name() == "sqlite":
            if parsed.database and parsed.database != ":memory:":
                Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        else:
            options["pool_pre_ping"] = True  # survive a database restart without errors
        engine = create_async_engine(url, **options)
        if parsed.get_backend_name() == "sqlite":
            event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        try:
            if upgrade:
                await migrate.upgrade(engine)
        except BaseException:
            await engine.dispose()
            raise
        return cls(engine)

    async def close(self) -> None:
        """Close every pooled connection."""
        await self.engine.dispose()


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    # With WAL, NORMAL syncs at checkpoints only: commits survive a process crash (the
    # durability the ledger journal has too), not a power cut, at a fraction of the fsyncs.
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
