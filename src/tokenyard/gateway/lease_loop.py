"""The lease loop a gateway process's workers share (the Batch API's lane, background
responses): claim items from the store under a lease, run each as a task at the key that
queued it, renew the leases of what runs, and give back what is refused for now.

Each round the lane first does its own chores (`Work.round`: write ends, end batches,
look for cancels, purge), then, while it has room (`Work.room`), claims up to that many
items (in groups: it claims once at least `group` are free, or none runs) and starts
them; a third of the lease after the last renewal, it renews them all. A round that got
all it asked for goes again at once (there may be more); otherwise it waits `poll_s`
(doubled after each idle round, one that ran and found nothing, up to `idle_poll_s`:
an idle gateway does not ask the store several times a second), or until woken
(`wake`: an item ended, or this process queued or cancelled something), and then
`gather_s` more while items run, so that their ends are written together.

A run refused for now (`Busy`) gives its item back to the store and this worker claims
nothing for `retry_after_s`. A run whose key was revoked or expired runs with None (the
lane fails it with the reason). A run that fails otherwise (the store) is logged; its
lease runs out and the item runs again, here or elsewhere. `close` stops claiming and
gives the runs `grace_s` to end before it cancels them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar

from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.batches import Busy
from tokenyard.store.repo import Store
from tokenyard.store.sql import utcnow

logger = logging.getLogger("tokenyard.gateway")

Item = TypeVar("Item")
Name = TypeVar("Name", bound=Hashable)


class Work(Protocol[Item]):
    """What a lane supplies: how it claims, runs and ends its items."""

    async def round(self) -> None:
        """The lane's chores before it claims (they may raise: the round is logged and
        tried again)."""
        ...

    def room(self, now: float, running: int) -> tuple[int, int]:
        """(items that may start now, the smallest group worth a claim)."""
        ...

    async def claim(self, worker: str, limit: int) -> list[Item]:
        ...

    async def renew(self, worker: str) -> None:
        ...

    async def release(self, worker: str, item: Item) -> None:
        """Give `item` back to the store (refused for now)."""
        ...

    def key_id(self, item: Item) -> str:
        """The key whose item it is: the run is admitted, limited and billed under it."""
        ...

    async def run(self, item: Item, key: KeyContext | None) -> None:
        """Run `item` at `key` (None: revoked or expired); raise `Busy` to give it back."""
        ...

    def ended(self, item: Item) -> None:
        """Its run ended, however (called once, before the loop is woken)."""
        ...

    def describe(self, item: Item) -> str:
        """The item, in a log line."""
        ...


class Runs(dict[Name, "asyncio.Task[None]"]):
    """A lane's runs by name (their tasks), and the one way to stop one: `cut`."""

    def __init__(self) -> None:
        super().__init__()
        #: Runs inside `Work.run` (past their key's lookup).
        self.started: set[Name] = set()
        #: Runs cut while still reading their key: cut as they enter `Work.run`.
        self.early: dict[Name, str | None] = {}

    def cut(self, name: Name, msg: str | None = None) -> bool:
        """Cancel the run of `name` (with `msg`) where its lane handles it, inside
        `Work.run`: a run still reading its key is cut as it gets there (cancelled
        earlier, the cancel would escape the lane and its item keep its lease). False if
        no run of that name is here."""
        task = self.get(name)
        if task is None:
            return False
        if name in self.started:
            task.cancel(msg)
        else:
            self.early[name] = msg
        return True


class LeaseLoop(Generic[Item, Name]):
    """One lane's worker (see the module's docstring). `running`: the lane's runs by
    name (a dict the lane may also read, e.g. to cancel one)."""

    def __init__(self, what: str, work: Work[Item], store: Store, *,
                 name: Callable[[Item], Name], running: Runs[Name],
                 lease_s: float, poll_s: float, gather_s: float = 0.0,
                 idle_poll_s: float | None = None) -> None:
        self.what, self.work, self.store, self.name = what, work, store, name
        self.running = running
        self.lease_s, self.poll_s, self.gather_s = lease_s, poll_s, gather_s
        #: The longest wait between two idle rounds (default: 4 × poll_s, at most a
        #: third of the lease, so that a dead worker's items are found well within it).
        self.idle_poll_s = max(poll_s, idle_poll_s if idle_poll_s is not None
                               else min(4 * poll_s, lease_s / 3))
        self.worker = f"{socket.gethostname()[:30]}:{os.getpid()}:{secrets.token_hex(4)}"
        self.woken = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._idle_until = 0.0  # a run came back busy: nothing is claimed until then

    def wake(self) -> None:
        """Run a round now (not at the next poll)."""
        self.woken.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self, grace_s: float) -> None:
        """Stop claiming; give the runs `grace_s` to end, then cancel them."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        tasks = list(self.running.values())
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        renewed = loop.time()
        wait = self.poll_s
        while True:
            claimed: list[Item] = []
            free = 0
            try:
                await self.work.round()
                now = loop.time()
                free, group = self.work.room(now, len(self.running))
                if (free >= group or not self.running) and free > 0 \
                        and now >= self._idle_until:
                    claimed = await self.work.claim(self.worker, free)
                for item in claimed:
                    self.running[self.name(item)] = asyncio.create_task(self._run(item))
                now = loop.time()
                if self.running and now - renewed > self.lease_s / 3:
                    await self.work.renew(self.worker)
                    renewed = now
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("the %s's round failed; trying again", self.what)
            if claimed and len(claimed) == free:
                continue  # as many as it asked for: there may be more
            idle = not claimed and not self.running
            this_wait = wait if idle else self.poll_s
            wait = min(wait * 2, self.idle_poll_s) if idle else self.poll_s
            self.woken.clear()
            try:
                await asyncio.wait_for(self.woken.wait(), this_wait)
                wait = self.poll_s  # woken: something happened here
            except TimeoutError:
                pass
            if self.running and self.gather_s:
                await asyncio.sleep(self.gather_s)

    async def _run(self, item: Item) -> None:
        name = self.name(item)
        try:
            key = await self.store.find_key_by_id(self.work.key_id(item))
            if key is not None and not key.is_active(utcnow()):
                key = None
            self.running.started.add(name)
            if name in self.running.early:  # cut meanwhile: delivered inside the run
                task = asyncio.current_task()
                assert task is not None
                task.cancel(self.running.early.pop(name))
            await self.work.run(item, key)
        except Busy as busy:
            self._idle_until = asyncio.get_running_loop().time() + busy.retry_after_s
            with contextlib.suppress(Exception):
                await self.work.release(self.worker, item)
        except Exception:
            # The store failed: the lease runs out and the item is run again.
            logger.exception("%s failed to run", self.work.describe(item))
        finally:
            self.running.pop(name, None)
            self.running.started.discard(name)
            self.running.early.pop(name, None)
            self.work.ended(item)
            self.woken.set()
