"""Opening the database: URL normalisation, SQLite pragmas, migrations, engine and sessions."""

from __future__ import annotations

import contextlib
import os
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

        For SQLite the file is made private (`_private_sqlite`) and every connection gets
        WAL (readers never block the writer), synchronous=NORMAL and a busy timeout.
        """
        url = normalize_url(url)
        parsed = make_url(url)
        options: dict[str, Any] = {}
        if parsed.get_backend_name() == "sqlite":
            database = parsed.database or ""
            if database not in ("", ":memory:") and not database.startswith("file:"):
                _private_sqlite(Path(database))
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


#: The files SQLite keeps beside a database in WAL mode.
SQLITE_SIDE_FILES = ("-wal", "-shm")


def _private_sqlite(path: Path) -> None:
    """Make the SQLite file at `path` readable by its owner only: it holds stored
    responses, captured bodies and key hashes. Its directory, when created here, is 0700;
    the file is created 0600 before SQLite opens it (SQLite gives the -wal and -shm files
    it creates the database file's mode), and an existing file and its -wal and -shm are
    narrowed to 0600 (those a server of an earlier version left 0644)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    for file in (path, *(path.with_name(path.name + end) for end in SQLITE_SIDE_FILES)):
        with contextlib.suppress(FileNotFoundError, PermissionError):  # not ours: leave it
            if file.stat().st_mode & 0o077:
                file.chmod(0o600)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    # With WAL, NORMAL syncs at checkpoints only: commits survive a process crash (the
    # durability the ledger journal has too), not a power cut, at a fraction of the fsyncs.
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
