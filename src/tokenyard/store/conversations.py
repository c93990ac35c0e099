"""Conversations in the store: one row per conversation, its items a JSON list kept in
order. Every read and write takes `org_id` (None: any org, for admin keys): a row of
another org is treated exactly like a missing one. A change writes only over the
revision it read and is otherwise redone on the new row, so two responses appending to
one conversation both land, on SQLite as on PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, delete, insert, select, update

from tokenyard.store.db import Database
from tokenyard.store.tables import conversations


@dataclass(frozen=True)
class Conversation:
    """One conversation: its metadata and its items in order."""

    id: str
    org_id: str
    project_id: str | None
    key_id: str | None
    metadata: dict[str, str]
    items: list[dict[str, Any]]
    created_at: datetime
    revision: int = 0


def _mine(conversation_id: str, org_id: str | None) -> ColumnElement[bool]:
    t = conversations
    same = t.c.id == conversation_id
    return same if org_id is None else same & (t.c.org_id == org_id)


def _record(row: Any) -> Conversation:
    return Conversation(**{name: row[name] for name in Conversation.__dataclass_fields__})


async def insert_conversation(db: Database, record: Conversation) -> None:
    """Write one conversation (its id must be new)."""
    async with db.engine.begin() as conn:
        await conn.execute(insert(conversations), [asdict(record)])


async def get_conversation(db: Database, conversation_id: str, *,
                           org_id: str | None) -> Conversation | None:
    """The conversation if `org_id` may see it."""
    query = select(conversations).where(_mine(conversation_id, org_id))
    async with db.engine.connect() as conn:
        row = (await conn.execute(query)).mappings().first()
    return None if row is None else _record(row)


#: How many times a change is redone after losing a race before it gives up.
MAX_TRIES = 50


class ChangeConflict(RuntimeError):
    """A conversation changed under every one of `MAX_TRIES` tries of a change."""


async def change_conversation(
    db: Database, conversation_id: str, *, org_id: str | None,
    change: Callable[[Conversation], Conversation],
) -> Conversation | None:
    """Apply `change` to the conversation's metadata and items, redone on the new row
    when another change landed in between; the new row, or None if `org_id` cannot see
    it."""
    t = conversations
    for _ in range(MAX_TRIES):
        async with db.engine.connect() as conn:
            row = (await conn.execute(select(t).where(_mine(conversation_id, org_id))
                                      )).mappings().first()
        if row is None:
            return None
        old = _record(row)
        new = dataclasses.replace(change(old), revision=old.revision + 1)
        async with db.engine.begin() as conn:
            written = await conn.execute(
                update(t).where(t.c.id == conversation_id, t.c.revision == old.revision)
                .values(metadata=new.metadata, items=new.items, revision=new.revision))
        if written.rowcount == 1:
            return new
        await asyncio.sleep(0)
    raise ChangeConflict(f"conversation {conversation_id} kept changing")


async def delete_conversation(db: Database, conversation_id: str, *,
                              org_id: str | None) -> bool:
    """Delete the conversation; False if `org_id` could not see it."""
    async with db.engine.begin() as conn:
        result = await conn.execute(delete(conversations).where(_mine(conversation_id, org_id)))
        return result.rowcount == 1
