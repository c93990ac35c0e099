"""Stored responses: what the Responses API keeps so that a later request can continue a
conversation by `previous_response_id`, and a client can read back or delete it.

A key sees the responses of its own org (an admin key: every org's); anything else, and
anything past its retention, is simply not found. Saving is one INSERT on the request
path, so the very next request can continue from it. Expired rows are no longer served
from the moment they expire; a background task deletes them at start and every
`purge_every_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from tokenyard.errors import overloaded
from tokenyard.gateway.regions import require_data_region
from tokenyard.store.records import KeyContext
from tokenyard.store.repo import Store
from tokenyard.store.responses import (
    StoredResponse,
    delete_response,
    get_response,
    insert_response,
    purge_expired,
    response_chain,
)

__all__ = ["MAX_TURNS", "ChainTooLong", "ResponseNotFound", "StoredResponse",
           "StoredResponses", "UnknownItem", "page"]

logger = logging.getLogger("tokenyard.gateway")

#: The most turns a `previous_response_id` chain may have (a guard, never a real limit:
#: any model's context window is full long before).
MAX_TURNS = 100
#: Between two purges of expired responses.
PURGE_EVERY_S = 300.0
#: The id prefix of an input item without an id, by its type (OpenAI's where it has one).
ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                 "reasoning": "rs", "compaction": "cmp"}


class ResponseNotFound(LookupError):
    """No response `response_id` that this key may see (unknown, another org's, deleted
    or expired): for a chain, the first link that is missing."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


class ChainTooLong(ValueError):
    """A `previous_response_id` chain of more than `MAX_TURNS` turns."""


class UnknownItem(LookupError):
    """A paging cursor (`param`: 'after' or 'before') naming no item of the list."""

    def __init__(self, param: str, item_id: str) -> None:
        super().__init__(item_id)
        self.param = param
        self.item_id = item_id


@contextlib.contextmanager
def _store_failures() -> Iterator[None]:
    """A failing store as a 503 the client may retry (with retry-after), never a 500."""
    try:
        yield
    except Exception as exc:
        logger.warning("the store of responses failed: %r", exc)
        raise overloaded(1.0, "The gateway's store of responses is unavailable; retry "
                         "after a short wait.") from None


def _org_scope(key: KeyContext) -> str | None:
    """The org whose responses `key` may see (None: all of them, for an admin key)."""
    return None if key.scopes.admin else key.org_id


def with_ids(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as they are listed back: each with an id, messages typed as such and
    their text content as a list of parts (OpenAI's listing shows them so)."""
    out = []
    for item in items:
        item = dict(item)
        if "role" in item and "type" not in item:
            item["type"] = "message"
        if item.get("type") == "message" and isinstance(item.get("content"), str):
            part = ({"type": "output_text", "text": item["content"], "annotations": []}
                    if item.get("role") == "assistant"
                    else {"type": "input_text", "text": item["content"]})
            item["content"] = [part]
        if not item.get("id"):
            prefix = ITEM_PREFIXES.get(str(item.get("type")), "item")
            item["id"] = f"{prefix}_{secrets.token_hex(24)}"
        out.append(item)
    return out


def page(
    items: Sequence[dict[str, Any]], *, limit: int, order: str,
    after: str | None = None, before: str | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """One page of `items` (kept in input order) listed in `order` ('asc' or 'desc'):
    the `limit` items after the cursor `after`, or the `limit` just before `before`;
    and whether more lie beyond the page in that direction."""
    listed = list(items) if order == "asc" else list(items)[::-1]
    ids = [item.get("id") for item in listed]
    start, end = 0, len(listed)
    for param, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise UnknownItem(param, cursor)
    if after is not None:
        start = ids.index(after) + 1
    if before is not None:
        end = ids.index(before)
    window = listed[start:end]
    if before is not None and after is None:
        return window[-limit:], len(window) > limit
    return window[:limit], len(window) > limit


class StoredResponses:
    """Save, read, delete and chain stored responses; purge the expired ones."""

    def __init__(self, store: Store, *, retention_days: float,
                 purge_every_s: float = PURGE_EVERY_S, region: str | None = None) -> None:
        self.store = store
        #: This gateway's region (`serve --region`): an org bound to others reads its
        #: stored responses elsewhere (403).
        self.region = region
        self.retention = timedelta(days=retention_days)
        self.purge_every_s = purge_every_s
        self._task: asyncio.Task[None] | None = None

    async def save(self, key: KeyContext, response: dict[str, Any],
                   input_items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Store `response` (its `id` and `previous_response_id` are read from it) and its
        turn's input items for `key`'s org; returns the items as stored (with ids)."""
        now = self.store.clock()
        items = with_ids(input_items)
        with _store_failures():
            await insert_response(self.store.db, StoredResponse(
                id=str(response["id"]), org_id=key.org_id, project_id=key.project_id,
                key_id=key.key_id, previous_response_id=response.get("previous_response_id"),
                response=response, input_items=items, created_at=now,
                expires_at=now + self.retention,
            ))
        return items

    async def get(self, key: KeyContext, response_id: str) -> StoredResponse | None:
        """The response if `key` may see it."""
        require_data_region(self.region, key.allowed_regions, "stored responses")
        with _store_failures():
            return await get_response(self.store.db, response_id, now=self.store.clock(),
                                      org_id=_org_scope(key))

    async def delete(self, key: KeyContext, response_id: str) -> bool:
        """Delete the response; False if `key` could not see it."""
        require_data_region(self.region, key.allowed_regions, "stored responses")
        with _store_failures():
            return await delete_response(self.store.db, response_id, now=self.store.clock(),
                                         org_id=_org_scope(key))

    async def conversation(self, key: KeyContext, response_id: str,
                           max_turns: int = MAX_TURNS) -> list[dict[str, Any]]:
        """The conversation up to and including `response_id`, oldest turn first: each
        turn's input items, then its response's output items. Raises `ResponseNotFound`
        naming the first missing link, `ChainTooLong` past `max_turns` turns."""
        require_data_region(self.region, key.allowed_regions, "stored responses")
        with _store_failures():
            chain = await response_chain(self.store.db, response_id, now=self.store.clock(),
                                         org_id=_org_scope(key), limit=max_turns + 1)
        if not chain:
            raise ResponseNotFound(response_id)
        if len(chain) > max_turns:
            raise ChainTooLong(f"the chain of {response_id} has more than {max_turns} turns")
        missing = chain[-1].previous_response_id
        if missing is not None:
            raise ResponseNotFound(missing)
        items: list[dict[str, Any]] = []
        for turn in reversed(chain):
            items += turn.input_items
            items += turn.response.get("output") or []
        return items

    async def purge(self) -> int:
        """Delete the expired responses now; how many went."""
        return await purge_expired(self.store.db, self.store.clock())

    def start(self) -> None:
        """Start the background purge (its first run is now)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._purge_loop())

    async def _purge_loop(self) -> None:
        while True:
            try:
                if purged := await self.purge():
                    logger.info("purged %d expired stored responses", purged)
            except Exception as exc:  # the store is down: try again next round
                logger.warning("purging expired stored responses failed: %r", exc)
            await asyncio.sleep(self.purge_every_s)

    async def close(self) -> None:
        """Stop the background purge."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
