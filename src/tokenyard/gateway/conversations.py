"""Conversations (the Conversations API): what a client keeps on the server so that
each response made with `conversation` sees the items before it and adds its own.

A key sees the conversations of its own org (an admin key: every org's); anything else
is simply not found. An org bound to other regions reads its conversations there (403),
as for stored responses. Items get ids when added (`with_ids`) and keep their order.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from typing import Any

from tokenyard.gateway.regions import require_data_region
from tokenyard.gateway.responses import _org_scope, _store_failures, with_ids
from tokenyard.store.conversations import (
    Conversation,
    change_conversation,
    delete_conversation,
    get_conversation,
    insert_conversation,
)
from tokenyard.store.records import KeyContext
from tokenyard.store.repo import Store

__all__ = ["Conversation", "Conversations", "conversation_object"]


def conversation_object(conversation: Conversation) -> dict[str, Any]:
    """The API's `conversation` object."""
    return {"id": conversation.id, "object": "conversation",
            "created_at": int(conversation.created_at.timestamp()),
            "metadata": conversation.metadata}


class Conversations:
    """Create, read, change and delete conversations and their items for a key."""

    def __init__(self, store: Store, *, region: str | None = None) -> None:
        self.store = store
        self.region = region

    def _scope(self, key: KeyContext) -> str | None:
        require_data_region(self.region, key.allowed_regions, "conversations")
        return _org_scope(key)

    async def create(self, key: KeyContext, metadata: dict[str, str],
                     items: Sequence[dict[str, Any]]) -> Conversation:
        """A new conversation of `key`'s org holding `items`."""
        require_data_region(self.region, key.allowed_regions, "conversations")
        record = Conversation(
            id=f"conv_{secrets.token_hex(24)}", org_id=key.org_id,
            project_id=key.project_id, key_id=key.key_id, metadata=dict(metadata),
            items=with_ids(items), created_at=self.store.clock())
        with _store_failures():
            await insert_conversation(self.store.db, record)
        return record

    async def get(self, key: KeyContext, conversation_id: str) -> Conversation | None:
        """The conversation if `key` may see it."""
        scope = self._scope(key)
        with _store_failures():
            return await get_conversation(self.store.db, conversation_id, org_id=scope)

    async def delete(self, key: KeyContext, conversation_id: str) -> bool:
        """Delete the conversation; False if `key` could not see it."""
        scope = self._scope(key)
        with _store_failures():
            return await delete_conversation(self.store.db, conversation_id, org_id=scope)

    async def set_metadata(self, key: KeyContext, conversation_id: str,
                           metadata: dict[str, str]) -> Conversation | None:
        """Replace the conversation's metadata; None if `key` cannot see it."""
        scope = self._scope(key)
        with _store_failures():
            return await change_conversation(
                self.store.db, conversation_id, org_id=scope,
                change=lambda c: dataclasses.replace(c, metadata=dict(metadata)))

    async def add_items(self, key: KeyContext, conversation_id: str,
                        items: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """Append `items` (given ids where they have none); the items as added, or None
        if `key` cannot see the conversation."""
        scope = self._scope(key)
        added = with_ids(items)
        with _store_failures():
            changed = await change_conversation(
                self.store.db, conversation_id, org_id=scope,
                change=lambda c: dataclasses.replace(c, items=[*c.items, *added]))
        return None if changed is None else added

    async def delete_item(self, key: KeyContext, conversation_id: str,
                          item_id: str) -> tuple[Conversation | None, bool]:
        """Remove one item: the conversation after (None if `key` cannot see it), and
        whether it held the item."""
        scope = self._scope(key)
        found: list[bool] = []

        def drop(c: Conversation) -> Conversation:
            kept = [item for item in c.items if item.get("id") != item_id]
            found.append(len(kept) < len(c.items))
            return dataclasses.replace(c, items=kept)

        with _store_failures():
            changed = await change_conversation(self.store.db, conversation_id,
                                                org_id=scope, change=drop)
        return changed, bool(found and found[-1])
