"""Recording shadow comparisons off the request path.

`ShadowRecorder.record` only queues a result; a background task writes what has queued
in one transaction every `flush_s` (a failed write is logged and dropped: a shadow
comparison is a measurement, never worth slowing or failing a request for). The queue
is bounded, so a store that is down costs memory up to `max_pending` rows, no more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime

from tokenyard.store.repo import Store
from tokenyard.store.shadow import (
    ShadowRecord,
    ShadowReportRow,
    insert_shadow_results,
    shadow_report,
)

__all__ = ["ShadowRecord", "ShadowRecorder", "ShadowReportRow", "shadow_report_of"]

logger = logging.getLogger("tokenyard.gateway")


class ShadowRecorder:
    """Batches shadow results into the store from a background task."""

    def __init__(self, store: Store, *, flush_s: float = 0.25, max_pending: int = 10_000) -> None:
        self.store = store
        self.flush_s = flush_s
        self.max_pending = max_pending
        self._pending: list[ShadowRecord] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    def record(self, result: ShadowRecord) -> None:
        """Queue one result (dropped, and counted, when the queue is full)."""
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            return
        self._pending.append(result)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.flush_s)  # let a batch gather
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """Write everything queued now."""
        batch, self._pending = self._pending, []
        try:
            await insert_shadow_results(self.store.db, batch)
        except Exception as exc:
            logger.warning("dropped %d shadow results: %s", len(batch), exc)

    async def close(self) -> None:
        """Stop the task and write what is left."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None
        await self.flush()


async def shadow_report_of(
    store: Store, *, alias: str | None = None, since: datetime | None = None,
) -> list[ShadowReportRow]:
    """The shadow report over `store` (see `store.shadow.shadow_report`)."""
    return await shadow_report(store.db, alias=alias, since=since)
