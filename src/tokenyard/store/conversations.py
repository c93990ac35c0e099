"""Conversations in the store: one row per conversation, its items a JSON list kept in
order. Every read and write takes `org_id` (None: any org, for admin keys): a row of
another org is treated exactly like a missing one. Items are changed under the row's
own transaction (`SELECT ... FOR UPDATE` where the database has it), so two responses
appending to one conversation both land."""

from __future__ import annotations

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


async def change_conversation(
    db: Database, conversation_id: str, *, org_id: str | None,
    change: Callable[[Conversation], Conversation],
) -> Conversation | None:
    """Apply `change` to the conversation's metadata and items in one transaction (the
    row locked where the database can); the new row, or None if `org_id` cannot see it."""
    query = select(conversations).where(_mine(conversation_id, org_id))
    if db.engine.dialect.name == "postgresql":
        query = query.with_for_update()
    async with db.engine.begin() as conn:
        row = (await conn.execute(query)).mappings().first()
        if row is None:
            return None
        new = change(_record(row))
        await conn.execute(update(conversations).where(conversations.c.id == conversation_id)
                           .values(metadata=new.metadata, items=new.items))
    return new


async def delete_conversation(db: Database, conversation_id: str, *,
                              org_id: str | None) -> bool:
    """Delete the conversation; False if `org_id` could not see it."""
    async with db.engine.begin() as conn:
        result = await conn.execute(delete(conversations).where(_mine(conversation_id, org_id)))
        return result.rowcount == 1
