"""Files of the Batch API in the store: what `POST /v1/files` took and the output and error
files of finished batches, per org, bytes included (so every gateway process of a fleet
serves the same files). Every read takes the caller's `org_id`: another org's file is
treated exactly like a missing one."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from tokenyard.store.db import Database
from tokenyard.store.tables import files


@dataclass(frozen=True)
class FileRecord:
    """One file's facts (its bytes are read apart: `file_content`)."""

    id: str
    org_id: str
    project_id: str | None
    filename: str
    purpose: str
    bytes: int
    lines: int
    created_at: datetime


_META = [files.c[name] for name in FileRecord.__dataclass_fields__]


def new_file_id() -> str:
    """OpenAI's shape of a file id: ``file-`` and 24 random characters."""
    return "file-" + secrets.token_hex(12)


def file_row(record: FileRecord, content: bytes) -> dict[str, Any]:
    """The `files` row of `record` with its bytes."""
    return {**{name: getattr(record, name) for name in FileRecord.__dataclass_fields__},
            "content": content}


async def insert_file(db: Database, record: FileRecord, content: bytes) -> None:
    """Write one file (its id must be new)."""
    async with db.engine.begin() as conn:
        await add_file(conn, record, content)


async def add_file(conn: AsyncConnection, record: FileRecord, content: bytes) -> None:
    """Write one file in the caller's transaction."""
    await conn.execute(insert(files), [file_row(record, content)])


async def get_file(db: Database, file_id: str, org_id: str) -> FileRecord | None:
    """The file `file_id` if it is `org_id`'s."""
    query = select(*_META).where(files.c.id == file_id, files.c.org_id == org_id)
    async with db.engine.connect() as conn:
        row = (await conn.execute(query)).mappings().first()
    return None if row is None else FileRecord(**row)


async def file_content(db: Database, file_id: str, org_id: str) -> bytes | None:
    """The bytes of `file_id` if it is `org_id`'s."""
    query = select(files.c.content).where(files.c.id == file_id, files.c.org_id == org_id)
    async with db.engine.connect() as conn:
        value = (await conn.execute(query)).scalar()
    return None if value is None else bytes(value)


async def list_files(
    db: Database, org_id: str, *, purpose: str | None, limit: int, after: str | None,
    newest_first: bool,
) -> list[FileRecord]:
    """`org_id`'s files by creation time, at most `limit`, from the one after `after`."""
    query = select(*_META).where(files.c.org_id == org_id)
    if purpose is not None:
        query = query.where(files.c.purpose == purpose)
    order = (files.c.created_at.desc(), files.c.id.desc()) if newest_first else (
        files.c.created_at.asc(), files.c.id.asc())
    async with db.engine.connect() as conn:
        if after is not None:
            mark = (await conn.execute(select(files.c.created_at, files.c.id).where(
                files.c.id == after, files.c.org_id == org_id))).first()
            if mark is not None:
                at, fid = mark
                query = query.where(
                    (files.c.created_at < at) | ((files.c.created_at == at) & (files.c.id < fid))
                    if newest_first else
                    (files.c.created_at > at) | ((files.c.created_at == at) & (files.c.id > fid)))
        rows = (await conn.execute(query.order_by(*order).limit(limit))).mappings().all()
    return [FileRecord(**row) for row in rows]


async def delete_file(db: Database, file_id: str, org_id: str) -> bool:
    """Delete `file_id`; False if it is not `org_id`'s."""
    async with db.engine.begin() as conn:
        result = await conn.execute(
            delete(files).where(files.c.id == file_id, files.c.org_id == org_id))
        return bool(result.rowcount)
