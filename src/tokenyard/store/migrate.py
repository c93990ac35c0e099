"""Alembic, configured in code: no alembic.ini is needed where the package is installed."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
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


def _run(connection: Connection, command_name: str, revision: str) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection  # env.py migrates on this connection
    getattr(command, command_name)(config, revision)
