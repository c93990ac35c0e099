"""The Batch API's lane: the batch worker of one gateway process.

It claims lines from the store in groups through the lease loop both lanes share
(`gateway/lease_loop.py`; `store/batches.claim`: a lease, so a line whose gateway died
is claimed again once the lease is past), runs each through the
`LineRunner` it was given — the same `Pipeline.run` a live request takes, under the
batch owner's key, at `BATCH_PRIORITY` and the deployment's batch price — with at most
`concurrency` lines in flight in this process (by default 128, a replica's
`max_num_seqs`: the lane fills a replica's idle seats as the engine alone would), and
writes the lines' ends in groups, one transaction a round, which also keeps the batch's
counts (a status read is one row).

Live traffic still gets the replicas first: the balancer's queue and the engine's
scheduler serve lower priority numbers first, so a live prompt goes ahead of the batch
lines' prompts in a step, and takes a batch line's seat or KV blocks by preempting it.
While this process has live requests in flight, and `YIELD_S` after, the lane keeps at
most `YIELD_LINES` lines running.

A cancel cuts the lines in flight: each round (at once when this process took the
cancel, else within `CANCEL_LOOK_S`) the lane reads the status of the batches it runs
lines of, and cancels the tasks of those no longer in progress. A cut line's run is
closed (the replica aborts it, its ticket settles with what it computed) and the line
ends `aborted`, billed for that. The lane ends batches whose lines are done (or that
were cancelled, or outlived their window), writing their result files once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.batches import Batches, LineRunner, Spent
from tokenyard.gateway.lease_loop import LeaseLoop, Runs
from tokenyard.store import batches as rows
from tokenyard.store.batches import Claimed, LineEnd
from tokenyard.store.files import FileRecord, new_file_id
from tokenyard.store.sql import utcnow

logger = logging.getLogger("tokenyard.gateway.batches")

#: While live requests are in flight in this process, and this long after the last,
#: the lane runs at most `YIELD_LINES` lines.
YIELD_S = 2.0
YIELD_LINES = 1
#: Lines are claimed once at least 1/CLAIM_GROUPS of the concurrency is free (or none
#: runs), so a claim takes a group, not one line per line ended.
CLAIM_GROUPS = 8
#: After a wake with lines running, the lane lets more ends gather before its round.
GATHER_S = 0.02
#: How often a lane running lines looks for cancels made by other processes.
CANCEL_LOOK_S = 0.25

Line = tuple[str, int]


def _line(item: Claimed) -> Line:
    return item.batch_id, item.line


class BatchLane:
    """The batch worker of one gateway process (see the module's docstring), a
    `LeaseLoop` over the store's batch lines. `live()`: this process's live requests in
    flight (`Gateway.live_open`)."""

    def __init__(self, batches: Batches, runner: LineRunner,
                 live: Callable[[], int] = lambda: 0) -> None:
        self.batches = batches
        self.db = batches.db
        self.settings = batches.settings
        self.runner = runner
        self.live = live
        self._running: Runs[Line] = Runs()
        self._aborting: set[Line] = set()
        self._ended: list[LineEnd] = []
        self.loop: LeaseLoop[Claimed, Line] = LeaseLoop(
            "batch worker", self, batches.store, name=_line, running=self._running,
            lease_s=self.settings.lease_s, poll_s=self.settings.poll_s, gather_s=GATHER_S)
        self.worker = self.loop.worker
        self._look = True  # look for cancels at the next round
        self._looked = float("-inf")
        batches.changed.append(self._changed)
        self._live_seen = float("-inf")

    def _changed(self) -> None:
        self._look = True
        self.loop.wake()

    def start(self) -> None:
        self.loop.start()

    async def close(self, grace_s: float = 10.0) -> None:
        """Stop claiming and give the lines still running `grace_s` to finish, then write
        their ends; those cut go back to the queue when their leases run out (another
        worker, or this one after a restart, runs them again; the ledger keeps the first
        row of a line)."""
        with contextlib.suppress(ValueError):
            self.batches.changed.remove(self._changed)
        await self.loop.close(grace_s)
        with contextlib.suppress(Exception):
            await self._write_ends()

    # -- the lease loop's `Work` ------------------------------------------------------

    async def round(self) -> None:
        """Write the ends gathered, end the batches that are done, and cut the lines of
        batches cancelled since the last look."""
        await self._write_ends()
        await self._end_due()
        now = asyncio.get_running_loop().time()
        if self._running and (self._look or now - self._looked >= CANCEL_LOOK_S):
            self._look, self._looked = False, now
            await self._abort_cancelled()

    def room(self, now: float, running: int) -> tuple[int, int]:
        """(lines that may start now, the group worth a claim): fewer while live
        requests run here (`YIELD_LINES` until `YIELD_S` after the last)."""
        if self.live() > 0:
            self._live_seen = now
        most = self.settings.concurrency
        if now - self._live_seen < YIELD_S:
            most = min(most, YIELD_LINES)
        return most - running, max(1, min(most, self.settings.concurrency // CLAIM_GROUPS))

    async def claim(self, worker: str, limit: int) -> list[Claimed]:
        return await rows.claim(self.db, worker, now=utcnow(),
                                lease_s=self.settings.lease_s, limit=limit)

    async def renew(self, worker: str) -> None:
        await rows.renew(self.db, worker, now=utcnow(), lease_s=self.settings.lease_s)

    async def release(self, worker: str, item: Claimed) -> None:
        await rows.release(self.db, item.batch_id, item.line, worker)

    def key_id(self, item: Claimed) -> str:
        return item.key_id

    async def run(self, item: Claimed, key: KeyContext | None) -> None:
        """Run the line; its end is written with the next round's. A line cut by its
        batch's cancel ends aborted, billed for what it computed."""
        spent = Spent()
        name = _line(item)
        try:
            end = await self.runner.run(item, key, spent)
        except asyncio.CancelledError:
            if name not in self._aborting:
                raise  # the lane closes: the line's lease runs out, it runs again
            end = spent.end(item, None, None)
        self._ended.append(end)

    def ended(self, item: Claimed) -> None:
        self._aborting.discard(_line(item))

    def describe(self, item: Claimed) -> str:
        return f"batch {item.batch_id} line {item.line}"

    async def _write_ends(self) -> None:
        """Write the lines ended since the last round, in one transaction."""
        if not self._ended:
            return
        ends, self._ended = self._ended, []
        try:
            written = await rows.finish_lines(self.db, self.worker, ends, now=utcnow())
        except BaseException:
            self._ended[:0] = ends  # tried again next round (the leases still hold)
            raise
        if len(written) < len(ends):
            logger.warning("%d batch lines were taken over before they ended",
                           len(ends) - len(written))

    async def _abort_cancelled(self) -> None:
        """Cut the lines in flight of batches no longer in progress (cancelled)."""
        status = await rows.statuses(self.db, sorted({b for b, _ in self._running}))
        for name in list(self._running):
            if status.get(name[0], "in_progress") != "in_progress" \
                    and name not in self._aborting:
                self._aborting.add(name)
                self._running.cut(name)

    async def _end_due(self) -> None:
        for record, status in await rows.due(self.db, utcnow()):
            results = await rows.results(self.db, record.id)
            now = utcnow()
            files = [(column, FileRecord(new_file_id(), record.org_id, record.project_id,
                                         name, "batch_output", len(content),
                                         content.count(b"\n"), now), content)
                     for column, name, content in self.runner.result_files(record, results,
                                                                           status)]
            if await rows.finalize(self.db, record, status, now=now, files=files):
                logger.info("batch %s %s", record.id, status)


__all__ = ["YIELD_LINES", "YIELD_S", "BatchLane"]
