"""Alembic environment: runs the migrations on a connection handed in by `store.migrate`.

Run programmatically (the normal path), `config.attributes["connection"]` holds a sync
facade of an async connection. Run from the `alembic` command line, it opens its own
async engine from `sqlalchemy.url`.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from tokenyard.store.tables import metadata


def run_on(connection: Connection) -> None:
    # Batch mode lets future ALTERs work on SQLite, which rebuilds tables to alter them.
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_with_own_engine(url: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(run_on)
    finally:
        await engine.dispose()


def main() -> None:
    config = context.config
    if context.is_offline_mode():
        context.configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    connection = config.attributes.get("connection")
    if connection is not None:
        run_on(connection)
        return
    from tokenyard.store.db import normalize_url

    asyncio.run(run_with_own_engine(normalize_url(config.get_main_option("sqlalchemy.url", ""))))


main()
