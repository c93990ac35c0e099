"""Rows written off the request path, in groups, by one background task (not the Batch
API's: that is `batches.py`).

A request only queues its row (`add`); the task wakes on the first row, lets a group
gather for `flush_s`, and writes what has queued in one call. A failed write is logged
and the group dropped: what these rows record (shadow comparisons, moderation events)
is never worth slowing or failing a request for. The queue is bounded, so a store that
is down costs at most `max_pending` rows of memory; rows past it are counted in
`dropped`. (The ledger is the one writer that must not lose a row: it journals to disk
first, see store/ledger.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

logger = logging.getLogger("tokenyard.gateway")

_T = TypeVar("_T")


class RowWriter(Generic[_T]):
    """Queues rows and writes them with `write(rows)` from a background task, started
    on the first row."""

    def __init__(self, write: Callable[[list[_T]], Awaitable[None]], what: str, *,
                 flush_s: float = 0.25, max_pending: int = 10_000) -> None:
        self._write = write
        self.what = what  # named in the log line of a dropped group
        self.flush_s = flush_s
        self.max_pending = max_pending
        self.pending: list[_T] = []
        self.dropped = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def add(self, row: _T) -> None:
        """Queue one row (dropped, and counted, when the queue is full)."""
        if len(self.pending) >= self.max_pending:
            self.dropped += 1
            return
        self.pending.append(row)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.flush_s)  # let a group gather
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """Write everything queued now."""
        group, self.pending = self.pending, []
        if not group:
            return
        try:
            await self._write(group)
        except Exception as exc:
            logger.warning("dropped %d %s: %s", len(group), self.what, exc)

    async def close(self) -> None:
        """Stop the task and write what is left."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None
        await self.flush()
