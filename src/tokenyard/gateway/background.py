"""Background responses (`background: true` on POST /v1/responses): kept in the store,
run by a worker in every gateway process, read, streamed and cancelled from any of them.

`Background` is what the routes call: it queues a response for the caller's org (in this
gateway's region: only a gateway of that region runs it), reads it and its events back,
cancels and deletes it, and wakes a local reader when new events are written.
`BackgroundLane` is the worker, on the lease loop it shares with the batch lane
(`gateway/lease_loop.py`): it claims queued responses from the store under a lease
(`store/background.py`), runs each
with the dialect's runner at the caller's key — through the same `Pipeline.run` as a live
request, so each model turn is admitted, limited and billed under that key — renews the
leases of what it runs, and gives back what the limits refuse for now (`Busy`). A
response whose worker died (kill -9) is claimed again once its lease is past and run
again from the start; its model turn's request id is the response's id, and the ledger
keeps one row per request id (`ON CONFLICT DO NOTHING`, the journal replayed after a
crash), so it is billed once; `finish` stores its one outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from tokenyard.config import ServeConfig
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.batches import Busy
from tokenyard.gateway.lease_loop import LeaseLoop, Runs
from tokenyard.gateway.regions import require_data_region
from tokenyard.gateway.responses import _org_scope, _store_failures, with_ids
from tokenyard.store import background as rows
from tokenyard.store.background import AT_WORK, QUEUED_EVENTS, BackgroundJob
from tokenyard.store.repo import Store
from tokenyard.store.responses import StoredResponse
from tokenyard.store.sql import utcnow

logger = logging.getLogger("tokenyard.gateway.background")

#: Between two purges of expired background responses.
PURGE_EVERY_S = 300.0
#: The message of the cancellation of a run its client cancelled (`Background.cancel`),
#: which its runner records as the request's end (a stop of the process is not one).
CANCELLED = "cancelled by its client"


@dataclass(frozen=True)
class BackgroundSettings:
    #: Responses one gateway process runs at once.
    concurrency: int = ServeConfig.background_concurrency
    #: How long a claimed response stays its worker's without a renewal.
    lease_s: float = ServeConfig.background_lease_s
    #: Between looks at the store when there is nothing to claim.
    poll_s: float = 0.5
    #: A running response's events are written at most this long after they are made.
    flush_s: float = 0.1
    #: Claims after which a response that never finished fails instead of running again.
    max_attempts: int = 3
    #: A response the limits keep refusing fails once it is this old.
    patience_s: float = 600.0
    #: How long an ended response can be read back.
    retention: timedelta = timedelta(days=ServeConfig.responses_retention_days)

    @classmethod
    def of(cls, config: ServeConfig) -> BackgroundSettings:
        """The settings `config` holds (`background_*`, `responses_retention_days`)."""
        return cls(concurrency=config.background_concurrency,
                   lease_s=config.background_lease_s,
                   retention=timedelta(days=config.responses_retention_days))


class Lost(Exception):
    """The worker no longer holds the response: cancelled, deleted, or taken over by
    another worker after its lease ran out. Its run stops; nothing more is written."""


class Background:
    """Background responses as the routes use them; every call names the caller's key
    (its org's responses only; an admin key's: every org's)."""

    def __init__(self, store: Store, settings: BackgroundSettings,
                 region: str | None = None) -> None:
        self.store = store
        self.settings = settings
        #: This gateway's region (`serve --region`): it runs only the responses queued
        #: through a gateway of its region, and an org bound to others reads them there.
        self.region = region
        #: Set when this process's worker must look at the store now (a new response).
        self.queued: list[Callable[[], None]] = []
        self._changed: dict[str, asyncio.Event] = {}
        #: The responses this process runs, by id (what a cancel here stops at once).
        self.running: Runs[str] = Runs()

    def _scope(self, key: KeyContext) -> str | None:
        require_data_region(self.region, key.allowed_regions, "stored responses")
        return _org_scope(key)

    async def create(self, key: KeyContext, *, response: dict[str, Any], body: str,
                     earlier: Sequence[dict[str, Any]],
                     events: Sequence[dict[str, Any]]) -> BackgroundJob:
        """Queue `response` (its `id` is the response's) for `key`, to run `body` after
        the `earlier` items, with the events a stream of it opens with."""
        require_data_region(self.region, key.allowed_regions, "stored responses")
        now = utcnow()
        job = BackgroundJob(
            id=str(response["id"]), org_id=key.org_id, project_id=key.project_id,
            key_id=key.key_id, region=self.region, body=body, earlier=list(earlier),
            response=response, state="queued", attempts=0, created_at=now,
            expires_at=now + self.settings.retention)
        with _store_failures():
            await rows.insert_job(self.store.db, job, events)
        for wake in self.queued:
            wake()
        return job

    async def get(self, key: KeyContext, response_id: str) -> BackgroundJob | None:
        """The background response if `key` may see it."""
        scope = self._scope(key)
        with _store_failures():
            return await rows.get_job(self.store.db, response_id, now=utcnow(),
                                      org_id=scope)

    async def events_after(self, key: KeyContext, response_id: str, after: int,
                           ) -> tuple[str | None, list[dict[str, Any]]]:
        """The response's state (None: `key` cannot see it) and its events after
        sequence number `after`; when the state is 'done' or 'cancelled', that is all."""
        scope = self._scope(key)
        with _store_failures():
            return await rows.events_after(self.store.db, response_id, after, now=utcnow(),
                                           org_id=scope)

    async def cancel(self, key: KeyContext, job: BackgroundJob) -> bool:
        """End `job` as cancelled if it is still at work (its run here stops at once; in
        another process, at its next write); False if it had ended."""
        cancelled = job.response | {"status": "cancelled"}
        with _store_failures():
            done = await rows.cancel_job(self.store.db, job.id, now=utcnow(),
                                         org_id=self._scope(key), response=cancelled)
        if done:
            self.running.cut(job.id, CANCELLED)
        self.changed(job.id)
        return done

    async def delete(self, key: KeyContext, response_id: str) -> bool:
        """Delete the background response (its run, if any, stops at its next write)."""
        scope = self._scope(key)
        with _store_failures():
            gone = await rows.delete_job(self.store.db, response_id, now=utcnow(),
                                         org_id=scope)
        if gone:
            self.running.cut(response_id)
        return gone

    # -- readers in this process wait for the events its worker writes
    def changed(self, response_id: str) -> None:
        """Wake this process's readers of the response."""
        event = self._changed.pop(response_id, None)
        if event is not None:
            event.set()

    async def wait(self, response_id: str, timeout_s: float) -> None:
        """Until this process writes events of the response, or `timeout_s` passes (it
        may run in another process: the caller looks at the store again then)."""
        event = self._changed.setdefault(response_id, asyncio.Event())
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout_s)
        finally:  # not woken: forget it (a reader waiting beside looks again in time)
            if not event.is_set() and self._changed.get(response_id) is event:
                del self._changed[response_id]


@dataclass
class Held:
    """A response claimed by this process's worker, as its runner writes it: events go
    out in writes at most `flush_s` apart (a status change at once), each renewing the
    lease; `Lost` once the worker no longer holds it."""

    lane: BackgroundLane
    job: BackgroundJob
    _pending: list[dict[str, Any]] = field(default_factory=list)
    _written: float = 0.0

    @property
    def exhausted(self) -> bool:
        """Claimed more often than a response may be (its runs keep dying)."""
        return self.job.attempts > self.lane.background.settings.max_attempts

    @property
    def patient(self) -> bool:
        """Whether a refusal for now (the limits) may still send it back to the queue."""
        age = utcnow() - self.job.created_at
        return age.total_seconds() < self.lane.background.settings.patience_s

    async def send(self, events: Sequence[dict[str, Any]],
                   response: dict[str, Any] | None = None) -> None:
        """Add `events` (and, if given, the response object as it stands now: written at
        once); raises `Lost`."""
        self._pending.extend(events)
        now = asyncio.get_running_loop().time()
        if response is None and now - self._written < self.lane.background.settings.flush_s:
            return
        pending, self._pending = self._pending, []
        self._written = now
        background = self.lane.background
        with _store_failures():
            held = await rows.append(background.store.db, self.job.id, self.lane.worker,
                                     pending, now=utcnow(), lease_s=background.settings.lease_s,
                                     response=response)
        if not held:
            raise Lost(self.job.id)
        background.changed(self.job.id)

    async def finish(self, events: Sequence[dict[str, Any]], response: dict[str, Any],
                     input_items: Sequence[dict[str, Any]] | None) -> None:
        """End the response with its last `events` and its final object, stored for a
        later turn with `input_items` (None: not stored, it failed); raises `Lost`."""
        background, job = self.lane.background, self.job
        pending, self._pending = [*self._pending, *events], []
        now = utcnow()
        stored = None if input_items is None else StoredResponse(
            id=job.id, org_id=job.org_id, project_id=job.project_id, key_id=job.key_id,
            previous_response_id=response.get("previous_response_id"), response=response,
            input_items=with_ids(input_items), created_at=job.created_at,
            expires_at=job.expires_at)
        with _store_failures():
            done = await rows.finish(background.store.db, job.id, self.lane.worker, pending,
                                     now=now, response=response, stored=stored)
        background.changed(job.id)
        if not done:
            raise Lost(job.id)


#: The dialect's runner of one claimed response, at its key (None: revoked or expired).
Runner = Callable[[Held, KeyContext | None], Awaitable[None]]


def _job_id(job: BackgroundJob) -> str:
    return job.id


class BackgroundLane:
    """The background worker of one gateway process (see the module's docstring), a
    `LeaseLoop` over the store's queued responses."""

    def __init__(self, background: Background, run: Runner) -> None:
        self.background = background
        self.db = background.store.db
        self.settings = background.settings
        self.runner = run
        self.loop: LeaseLoop[BackgroundJob, str] = LeaseLoop(
            "background worker", self, background.store, name=_job_id,
            running=background.running, lease_s=self.settings.lease_s,
            poll_s=self.settings.poll_s)
        self.worker = self.loop.worker
        self._purged_at = float("-inf")
        background.queued.append(self.loop.wake)

    def start(self) -> None:
        self.loop.start()

    async def close(self, grace_s: float = 10.0) -> None:
        """Stop claiming and give the responses still running `grace_s` to finish; those
        cut then go back to the queue when their leases run out."""
        with contextlib.suppress(ValueError):
            self.background.queued.remove(self.loop.wake)
        await self.loop.close(grace_s)

    # -- the lease loop's `Work` ------------------------------------------------------

    async def round(self) -> None:
        await self._purge(asyncio.get_running_loop().time())

    def room(self, now: float, running: int) -> tuple[int, int]:
        return self.settings.concurrency - running, 1

    async def claim(self, worker: str, limit: int) -> list[BackgroundJob]:
        return await rows.claim(self.db, worker, self.background.region, now=utcnow(),
                                lease_s=self.settings.lease_s, limit=limit)

    async def renew(self, worker: str) -> None:
        await rows.renew(self.db, worker, now=utcnow(), lease_s=self.settings.lease_s)

    async def release(self, worker: str, item: BackgroundJob) -> None:
        await rows.release(self.db, item.id, worker)

    def key_id(self, item: BackgroundJob) -> str:
        return item.key_id

    async def run(self, item: BackgroundJob, key: KeyContext | None) -> None:
        try:
            await self.runner(Held(self, item), key)
        except Lost:
            logger.info("background response %s ended elsewhere (cancelled, deleted or "
                        "taken over)", item.id)
        except asyncio.CancelledError:
            pass  # cancelled here, or this process stops: the lease runs out

    def ended(self, item: BackgroundJob) -> None:
        self.background.changed(item.id)

    def describe(self, item: BackgroundJob) -> str:
        return f"background response {item.id}"

    async def _purge(self, now: float) -> None:
        if now - self._purged_at >= PURGE_EVERY_S:
            self._purged_at = now
            if purged := await rows.purge_expired(self.db, utcnow()):
                logger.info("purged %d expired background responses", purged)


__all__ = ["AT_WORK", "CANCELLED", "QUEUED_EVENTS", "Background", "BackgroundJob", "BackgroundLane",
           "BackgroundSettings", "Busy", "Held", "Lost", "Runner"]
