"""Models on demand: a pool whose replicas start with its first request and stop when it
has been idle (`load = "on_demand"` in the fleet file, `load_spec.py`), and the host's
budget of resident models (`ModelHost`, the fleet file's `[models]`).

An `OnDemand` model is `unloaded`, `loading`, `loaded` or `unloading`. A request that
finds no replica of its pool while the model is not loaded starts the load (once: later
ones join it) and waits for it in the pool's wait queue, by priority then arrival, for
up to the model's `load_timeout_s`; when the load is expected to take longer than that
wait allows (the last load's time is the expectation) the request is refused at once
with 503 and `retry-after`, never left hanging. The load's end wakes every waiter.

A loaded model with no request in flight for `idle_unload_s` is unloaded: its members
leave the pool in the same step that finds it idle (so no request can pick one up), then
its replicas stop. An unload asked for while requests run (the admin's, or room for
another model) takes the members out at once and stops the replicas once their requests
ended: unloading never cuts one. `pinned` models are never unloaded.

`ModelHost` counts the resident models (loading, loaded or still unloading); a load
beyond `max_resident_models` first unloads the least recently used unpinned model, idle
ones before busy ones; when every resident model is pinned the load fails and its
waiters get 503.

The replicas themselves are started and stopped by the callables the builder gives
(`cli/fleet.py`: local child processes): this module only decides when.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from tokenyard.balancer.member_clients import MemberClient
from tokenyard.balancer.members import Member
from tokenyard.balancer.replica_client import ReplicaOverloaded
from tokenyard.balancer.wait_queue import WaitQueue
from tokenyard.load_spec import OnDemandSpec


class Hosting(Protocol):
    """The pool of an on-demand model, as this module uses it (`balancer/pool.py`)."""

    members: list[Member]

    @property
    def inflight(self) -> int: ...

logger = logging.getLogger("tokenyard.balancer")

#: Starts a model's replicas: their (id, client) pairs once they serve.
Start = Callable[[], Awaitable[Sequence[tuple[str, MemberClient]]]]
#: Stops the replicas of these ids (each drains its requests first).
Stop = Callable[[Sequence[str]], Awaitable[None]]
#: How long an unload waits for the requests still running on its replicas.
UNLOAD_DRAIN_S = 600.0
#: The retry-after of the requests that waited for a load that failed.
FAILED_RETRY_AFTER_S = 5.0
#: The states of an on-demand model, as `/v1/models` shows them.
STATES = ("unloaded", "loading", "loaded", "unloading")


class ModelHost:
    """The resident on-demand models of one host, under `max_resident` (None: no limit)."""

    def __init__(self, max_resident: int | None = None) -> None:
        self.max_resident = max_resident
        self.models: list[OnDemand] = []

    def resident(self) -> list[OnDemand]:
        return [m for m in self.models if m.holds_slot]

    async def make_room(self, model: OnDemand, deadline: float) -> None:
        """Take a slot for `model`, unloading the least recently used unpinned model
        (idle ones first) while the host is full; RuntimeError once only pinned models
        are left, or at `deadline`."""
        while True:
            others = [m for m in self.resident() if m is not model]
            if self.max_resident is None or len(others) < self.max_resident:
                model.holds_slot = True  # in the step that counted: no other load races it
                return
            victims = [m for m in others if m.state == "loaded" and not m.pinned]
            if not victims and not any(m.state == "unloading" for m in others):
                raise RuntimeError(
                    f"{len(others)} models are resident (max_resident_models = "
                    f"{self.max_resident}) and none may be unloaded: "
                    f"{', '.join(sorted(m.name for m in others))}")
            if time.monotonic() >= deadline:
                raise RuntimeError("no room for it among the resident models in time")
            if victims:
                victim = min(victims, key=lambda m: (not m.idle, m.last_used))
                logger.info("unloading %s (least recently used) to load %s", victim.name,
                            model.name, extra={"event": "model_evicted",
                                               "deployment": victim.name, "for": model.name})
                await victim.unload()
            else:  # an unload under way frees its slot when its replicas have stopped
                await asyncio.sleep(0.1)


class OnDemand:
    """One on-demand deployment's load state (see the module's docstring)."""

    def __init__(self, name: str, spec: OnDemandSpec, start: Start, stop: Stop,
                 host: ModelHost | None = None) -> None:
        self.name, self.spec = name, spec
        self._start, self._stop = start, stop
        self.host = host or ModelHost()
        self.host.models.append(self)
        self.pinned = spec.pinned
        self.state = "unloaded"
        self.holds_slot = False
        self.last_used = time.monotonic()
        #: Seconds each load took, in order (the last is the next one's expectation).
        self.load_times: list[float] = []
        self.loads = self.unloads = 0
        #: Why the last load failed (None: it did not).
        self.error: str | None = None
        #: Runs after the replicas serve and before the model counts as loaded (the
        #: gateway learns the model's facts there: `gateway/kinds.py`).
        self.after_load: Callable[[], Awaitable[None]] | None = None
        self._pool: Hosting | None = None
        self._waiting = WaitQueue()
        self._loading: asyncio.Task[None] | None = None
        self._unloading: asyncio.Task[None] | None = None
        self._idle: asyncio.Task[None] | None = None
        self._load_began = 0.0
        self._attempt = 0

    def attach(self, pool: Hosting, waiting: WaitQueue) -> None:
        """Load into `pool`'s members; `waiting`: its wait queue (woken by a load's end)."""
        self._pool, self._waiting = pool, waiting

    @property
    def pool(self) -> Hosting:
        assert self._pool is not None, "attach the pool first"
        return self._pool

    @property
    def idle(self) -> bool:
        """No request of the pool is in flight (nor waiting in it)."""
        return self.pool.inflight == 0

    def touch(self) -> None:
        """A request used the model now (its idle time starts again)."""
        self.last_used = time.monotonic()

    def expected_left(self) -> float | None:
        """Seconds until the load under way should end, by the last load's time (None: no
        load has ended yet, so nothing is known)."""
        if self.state != "loading" or not self.load_times:
            return None
        return max(0.0, self.load_times[-1] - (time.monotonic() - self._load_began))

    # ------------------------------------------------------------------ loading
    def ensure_loading(self) -> None:
        """Start the load unless the model is loaded or loading."""
        if self.state in ("loading", "loaded"):
            return
        self.state = "loading"
        self.error = None
        self._attempt += 1
        self._load_began = time.monotonic()
        self._loading = asyncio.create_task(self._load())

    async def load(self) -> None:
        """Load now (the admin's), and wait for it; RuntimeError when it fails."""
        self.touch()
        self.ensure_loading()
        if self._loading is not None:
            await asyncio.shield(self._loading)
        if self.state != "loaded":
            raise RuntimeError(self.error or f"{self.name} did not load")

    async def _load(self) -> None:
        began = time.monotonic()
        try:
            if self._unloading is not None:  # a reload right after an unload: let it end
                await asyncio.shield(self._unloading)
            await self.host.make_room(self, began + self.spec.load_timeout_s)
            members = await self._start()
            self.pool.members.extend(Member(mid, client) for mid, client in members)
            if self.after_load is not None:
                await self.after_load()
        except Exception as exc:
            await self._failed(exc)
        else:
            took = time.monotonic() - began
            self.load_times.append(took)
            self.loads += 1
            self.state = "loaded"
            self.touch()
            logger.info("loaded %s in %.2f s", self.name, took, extra={
                "event": "model_loaded", "deployment": self.name, "seconds": round(took, 3)})
            if self._idle is None or self._idle.done():
                self._idle = asyncio.create_task(self._idle_loop())
        finally:
            self._loading = None
            self._wake_all()

    async def _failed(self, exc: Exception) -> None:
        self.error = f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc)
        logger.error("loading %s failed: %s", self.name, self.error, extra={
            "event": "model_load_failed", "deployment": self.name, "error": self.error})
        started = [m.id for m in self.pool.members]
        self.pool.members.clear()
        if started:
            with contextlib.suppress(Exception):
                await self._stop(started)
        self.state = "unloaded"
        self.holds_slot = False

    def _wake_all(self) -> None:
        for _ in range(len(self._waiting)):
            self._waiting.wake()

    async def wait_loaded(self, waiting: WaitQueue, priority: int, arrival: int,
                          deadline: float, max_waiting: int) -> float:
        """A request's wait for the model (see the module's docstring), in `waiting` by
        (`priority`, `arrival`); returns its deadline for what follows (the load's own
        timeout counts, not only the queue's). 503 (ReplicaOverloaded) with retry-after
        when the load would outlast the wait, or when it failed."""
        self.touch()
        self.ensure_loading()
        attempt = self._attempt
        deadline = max(deadline, self._load_began + self.spec.load_timeout_s)
        while self.state != "loaded":
            if self.state == "unloaded" and self._attempt == attempt and self.error:
                # Its reason (other models' names, a replica's exit) is the operator's.
                raise ReplicaOverloaded(FAILED_RETRY_AFTER_S, f"model {self.name} could "
                                        "not be loaded now", "model_load_failed")
            if self.state in ("unloaded", "unloading"):
                self.ensure_loading()
                attempt = self._attempt
            left = deadline - time.monotonic()
            expected = self.expected_left()
            if expected is not None and expected > left:
                raise ReplicaOverloaded(
                    max(1.0, math.ceil(expected)), f"model {self.name} is loading; it "
                    f"should be ready in about {math.ceil(expected)} s", "model_loading")
            await waiting.wait(priority, arrival, deadline,
                               max(1.0, expected or 1.0), max_waiting, self.name)
        return deadline

    # ------------------------------------------------------------------ unloading
    async def unload(self) -> bool:
        """Unload now (its running requests end first); False: it was not loaded."""
        if self.state == "unloading" and self._unloading is not None:
            await asyncio.shield(self._unloading)
            return True
        if self.state != "loaded":
            return False
        members = list(self.pool.members)
        self.pool.members.clear()  # in this step: no new request can pick one up
        self.state = "unloading"
        self._unloading = asyncio.create_task(self._drain_and_stop(members))
        await asyncio.shield(self._unloading)
        return True

    async def _drain_and_stop(self, members: list[Member]) -> None:
        try:
            deadline = time.monotonic() + UNLOAD_DRAIN_S
            while any(m.inflight for m in members) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for member in members:
                with contextlib.suppress(Exception):
                    await member.client.close()
            try:
                await self._stop([m.id for m in members])
            except Exception as exc:
                logger.error("stopping %s's replicas failed: %s", self.name, exc)
            self.unloads += 1
            logger.info("unloaded %s", self.name, extra={
                "event": "model_unloaded", "deployment": self.name})
        finally:
            self.holds_slot = False
            self._unloading = None
            if self.state == "unloading":
                self.state = "unloaded"

    async def _idle_loop(self) -> None:
        """Unload the model once it has been idle for `idle_unload_s`."""
        while self.state == "loaded":
            left = self.last_used + self.spec.idle_unload_s - time.monotonic()
            if left > 0:
                await asyncio.sleep(min(left, 1.0) if left > 0.05 else 0.05)
                continue
            if self.pinned or not self.idle:
                self.touch()  # busy: idle time starts when its requests end
                continue
            await self.unload()

    async def close(self) -> None:
        """Stop its replicas (the server stops or the deployment left the fleet)."""
        for task in (self._idle, self._loading):
            if task is not None:
                task.cancel()
        if self.state == "loaded":
            await self.unload()
        if self in self.host.models:
            self.host.models.remove(self)

    def snapshot(self) -> dict[str, Any]:
        """Its state for `/v1/models` and the admin API."""
        return {
            "state": self.state, "pinned": self.pinned,
            "idle_unload_s": self.spec.idle_unload_s,
            "idle_for_s": round(time.monotonic() - self.last_used, 3)
            if self.state == "loaded" else None,
            "loads": self.loads, "unloads": self.unloads,
            "last_load_s": round(self.load_times[-1], 3) if self.load_times else None,
            "error": self.error,
        }
