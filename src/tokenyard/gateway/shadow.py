"""Recording shadow comparisons off the request path.

`ShadowRecorder.add` only queues a result; a background task writes what has queued
in one transaction every `flush_s` (a failed write is logged and dropped: a shadow
comparison is a measurement, never worth slowing or failing a request for). The queue
is bounded, so a store that is down costs memory up to `max_pending` rows, no more.
"""

from __future__ import annotations

from datetime import datetime

from tokenyard.gateway.row_writer import RowWriter
from tokenyard.store.repo import Store
from tokenyard.store.shadow import (
    ShadowRecord,
    ShadowReportRow,
    insert_shadow_results,
    shadow_report,
)

__all__ = ["ShadowRecord", "ShadowRecorder", "ShadowReportRow", "shadow_report_of"]


class ShadowRecorder(RowWriter[ShadowRecord]):
    """Batches shadow results into the store from a background task."""

    def __init__(self, store: Store, *, flush_s: float = 0.25, max_pending: int = 10_000) -> None:
        super().__init__(lambda batch: insert_shadow_results(store.db, batch),
                         "shadow results", flush_s=flush_s, max_pending=max_pending)
        self.store = store


async def shadow_report_of(
    store: Store, *, alias: str | None = None, since: datetime | None = None,
) -> list[ShadowReportRow]:
    """The shadow report over `store` (see `store.shadow.shadow_report`)."""
    return await shadow_report(store.db, alias=alias, since=since)
