"""The Batch API's lane: the batch worker of one gateway process.

It claims lines from the store in groups (`store/batches.claim`: a lease, so a line whose
gateway died is claimed again once the lease is past), runs each through the
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
import os
import secrets
import socket
from collections.abc import Callable

from tokenyard.gateway.batches import Batches, Busy, LineRunner, Spent
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


class BatchLane:
    """The batch worker of one gateway process (see the module's docstring). `live()`:
    this process's live requests in flight (`Gateway.live_open`)."""

    def __init__(self, batches: Batches, runner: LineRunner,
                 live: Callable[[], int] = lambda: 0) -> None:
        self.batches = batches
        self.db = batches.db
        self.settings = batches.settings
        self.runner = runner
        self.live = live
        self.worker = f"{socket.gethostname()[:30]}:{os.getpid()}:{secrets.token_hex(4)}"
        self._running: dict[Line, asyncio.Task[None]] = {}
        self._aborting: set[Line] = set()
        self._ended: list[LineEnd] = []
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._look = True  # look for cancels at the next round
        batches.changed.append(self._changed)
        self._live_seen = float("-inf")
        self._idle_until = 0.0  # a line came back busy: nothing is claimed until then

    def _changed(self) -> None:
        self._look = True
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self, grace_s: float = 10.0) -> None:
        """Stop claiming and give the lines still running `grace_s` to finish, then write
        their ends; those cut go back to the queue when their leases run out (another
        worker, or this one after a restart, runs them again; the ledger keeps the first
        row of a line)."""
        with contextlib.suppress(ValueError):
            self.batches.changed.remove(self._changed)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        tasks = list(self._running.values())
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._write_ends()

    def _room(self, now: float) -> tuple[int, int]:
        """(lines that may start now, the most that may run now)."""
        if self.live() > 0:
            self._live_seen = now
        most = self.settings.concurrency
        if now - self._live_seen < YIELD_S:
            most = min(most, YIELD_LINES)
        return most - len(self._running), most

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        renewed = looked = loop.time()
        while True:
            claimed: list[Claimed] = []
            free = 0
            try:
                await self._write_ends()
                await self._end_due()
                now = loop.time()
                if self._running and (self._look or now - looked >= CANCEL_LOOK_S):
                    self._look, looked = False, now
                    await self._abort_cancelled()
                free, most = self._room(now)
                group = max(1, min(most, self.settings.concurrency // CLAIM_GROUPS))
                if (free >= group or not self._running) and free > 0 \
                        and now >= self._idle_until:
                    claimed = await rows.claim(self.db, self.worker, now=utcnow(),
                                               lease_s=self.settings.lease_s, limit=free)
                for line in claimed:
                    task = asyncio.create_task(self._run(line))
                    self._running[(line.batch_id, line.line)] = task
                now = loop.time()
                if self._running and now - renewed > self.settings.lease_s / 3:
                    await rows.renew(self.db, self.worker, now=utcnow(),
                                     lease_s=self.settings.lease_s)
                    renewed = now
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("the batch worker's round failed; trying again")
            if claimed and len(claimed) == free:
                continue  # as many as it asked for: there may be more
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.poll_s)
            if self._running:
                await asyncio.sleep(GATHER_S)

    async def _run(self, line: Claimed) -> None:
        spent = Spent()
        name = (line.batch_id, line.line)
        try:
            key = await self.batches.store.find_key_by_id(line.key_id)
            if key is not None and not key.is_active(utcnow()):
                key = None
            end = await self.runner.run(line, key, spent)
        except Busy as busy:
            self._idle_until = asyncio.get_running_loop().time() + busy.retry_after_s
            with contextlib.suppress(Exception):
                await rows.release(self.db, line.batch_id, line.line, self.worker)
            return
        except asyncio.CancelledError:
            if name not in self._aborting:
                raise  # the lane closes: the line's lease runs out, it runs again
            end = spent.end(line, None, None)
        except Exception:
            # The store failed: the lease runs out and the line is run again.
            logger.exception("batch %s line %d failed to run", line.batch_id, line.line)
            return
        finally:
            self._running.pop(name, None)
            self._aborting.discard(name)
            self._wake.set()
        self._ended.append(end)

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
        for name, task in list(self._running.items()):
            if status.get(name[0], "in_progress") != "in_progress" \
                    and name not in self._aborting:
                self._aborting.add(name)
                task.cancel()

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
