"""Alembic, configured in code: no alembic.ini is needed where the package is installed.

Alembic logs two lines of its own and one per migration at info; a first start ran a
dozen of them before the banner. They are kept at warning here, and one line says what
changed (`event: migrated`, from and to which revision)."""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def alembic_config(url: str | None = None) -> Config:
    """An alembic Config pointing at the packaged migrations (and at `url`, if given)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url:
        # ConfigParser interpolates '%', which URL-escaped passwords contain.
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    """`alembic upgrade <revision>` on `engine`, in one transaction where the backend allows."""
    async with engine.begin() as connection:
        await connection.run_sync(_run, "upgrade", revision)


async def downgrade(engine: AsyncEngine, revision: str = "base") -> None:
    """`alembic downgrade <revision>` on `engine` (default: drop everything)."""
    async with engine.begin() as connection:
        await connection.run_sync(_run, "downgrade", revision)


logger = logging.getLogger("tokenyard.store")


def _run(connection: Connection, command_name: str, revision: str) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection  # env.py migrates on this connection
    before = MigrationContext.configure(connection).get_current_revision()
    quiet = logging.getLogger("alembic")
    level = quiet.level
    quiet.setLevel(max(level, logging.WARNING))
    try:
        getattr(command, command_name)(config, revision)
    finally:
        quiet.setLevel(level)
    after = MigrationContext.configure(connection).get_current_revision()
    if after != before:
        logger.info("database migrated from %s to %s", before or "an empty database",
                    after or "an empty database",
                    extra={"event": "migrated", "from": before, "to": after})
