"""Failover: a request tried on a pool's members in the policy's order until one takes
it, and the full pool's wait.

A request that has not received its first byte is tried on the next member (each at
most once); one that has, ends with the error (the caller's stream gets a clean error
event). A member that answers "draining" is skipped the same way, and one that answers
"full" too; when every available member was full, the request waits in the pool's
`WaitQueue` (by priority, then arrival, up to `queue_timeout_s`), woken as a request of
the pool ends, and then tries them all again; then, or when `queue_max` already wait,
503 with retry-after.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from tokenyard.balancer.health import record_failure, record_success
from tokenyard.balancer.members import Lease, Member
from tokenyard.balancer.on_demand import OnDemand
from tokenyard.balancer.policy import RequestFacts
from tokenyard.balancer.replica_client import (
    ReplicaConnectionError,
    ReplicaError,
    ReplicaOverloaded,
    ReplicaStreamError,
    ReplicaUnauthorized,
)
from tokenyard.balancer.wait_queue import WaitQueue
from tokenyard.deployments import BalancerSpec
from tokenyard.telemetry.timeline import Timeline

_T = TypeVar("_T")

#: The members that may take a request now, best first (none tried in `exclude`).
Order = Callable[[RequestFacts, set[str]], Awaitable[list[Member]]]
#: Record that a member now holds the prompt blocks `hashes`.
Placed = Callable[[Sequence[int], Member], Awaitable[None]]


class Failover:
    """A pool's attempts and its wait queue (see the module's docstring). `owner`: the
    member each open request (by id) runs on, so a stop or an abort reaches it."""

    def __init__(self, name: str, spec: BalancerSpec, order: Order, placed: Placed) -> None:
        self.name, self.spec, self.order, self.placed = name, spec, order, placed
        self.waiting = WaitQueue()
        self.owner: dict[str, Member] = {}
        #: Requests of the pool in flight (streams open, calls running).
        self.inflight = 0
        #: Decisions taken (each try of the members in order), for the `balance` stage.
        self.decisions = 0
        #: Hears that a member took a request of a LoRA adapter (the pool's LoraHomes).
        self.served_lora: Callable[[str, Member], None] = lambda lora, member: None
        #: An on-demand model's load state (`balancer/on_demand.py`); None: its replicas
        #: run from the start.
        self.demand: OnDemand | None = None

    def wake(self) -> None:
        """Let the first waiting request (by priority) try again."""
        self.waiting.wake()

    async def acquire(
        self,
        attempt: Callable[[Member], Awaitable[_T]],
        *,
        hashes: Sequence[int] = (),
        cost: int = 1,
        priority: int = 0,
        timeline: Timeline | None = None,
        lora: str | None = None,
    ) -> tuple[Lease, _T]:
        """Run `attempt` on the best member, failing over before the first byte; wait in
        the queue when every member is full. Returns the lease (release it when the
        request ends) and what `attempt` returned. The decisions' own time is the
        timeline's `balance` stage."""
        deadline = time.monotonic() + self.spec.queue_timeout_s
        facts = RequestFacts(hashes, cost, priority, lora)
        tried: set[str] = set()
        arrival = self.waiting.arrival()  # kept through every wait: FIFO in a class
        waited = False
        while True:
            demand = self.demand
            if demand is not None and demand.state != "loaded":
                # Its model is not loaded: start the load (once) and wait for it in line.
                deadline = await demand.wait_loaded(self.waiting, priority, arrival,
                                                    deadline, self.spec.queue_max)
                waited = True
                continue
            if self.waiting.ahead(priority, arrival):
                if waited:  # woken, but an earlier or more urgent request waits: its turn
                    self.waiting.wake()
                await self.waiting.wait(priority, arrival, deadline, 1.0,
                                        self.spec.queue_max, self.name)
                waited = True
                continue
            self.decisions += 1
            began = time.perf_counter_ns()
            order = await self.order(facts, tried)
            if timeline is not None:
                timeline.add("balance", time.perf_counter_ns() - began)
            full: ReplicaOverloaded | None = None
            last: ReplicaError | None = None
            for member in order:
                lease = self._lease(member, cost)
                try:
                    result = await attempt(member)
                except ReplicaOverloaded as exc:
                    lease.release(wake=False)
                    tried.add(member.id)
                    if exc.code != "draining":
                        full = exc
                    continue
                except (ReplicaConnectionError, ReplicaStreamError, ReplicaUnauthorized) as exc:
                    lease.release(wake=False)
                    tried.add(member.id)
                    record_failure(member, exc, self.spec, self.name, before_first_byte=True)
                    last = exc
                    continue
                except BaseException:
                    lease.release(wake=False)
                    raise
                record_success(member)
                if lora is not None:
                    self.served_lora(lora, member)
                if hashes:
                    await self.placed(hashes, member)
                if waited:  # there may be room for the next in line too
                    self.waiting.wake()
                return lease, result
            if full is None:
                raise last or ReplicaConnectionError(
                    f"no replica of {self.name} is available")
            await self.waiting.wait(priority, arrival, deadline, full.retry_after or 1.0,
                                    self.spec.queue_max, self.name)
            waited = True
            tried.clear()  # everyone may have room now

    def _lease(self, member: Member, cost: int) -> Lease:
        member.inflight += 1
        member.inflight_tokens += cost
        return Lease(self, member, cost)

    async def stream(
        self,
        open_fn: Callable[[Member], AsyncIterator[_T]],
        *,
        hashes: Sequence[int] = (),
        cost: int = 1,
        priority: int = 0,
        request_id: str | None = None,
        timeline: Timeline | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[_T]:
        """A member's stream, opened with failover; its first item is read before the
        member is chosen for good. Closing it closes the member's stream."""
        self.inflight += 1
        lease: Lease | None = None
        stream: AsyncIterator[_T] | None = None
        try:
            async def attempt(member: Member) -> tuple[AsyncIterator[_T], _T]:
                if request_id is not None:  # `abort` reaches it before its first item too
                    self.owner[request_id] = member
                it = open_fn(member)
                try:
                    return it, await it.__anext__()
                except BaseException:
                    with contextlib.suppress(Exception):
                        await it.aclose()  # type: ignore[attr-defined]
                    raise

            lease, (stream, first) = await self.acquire(
                attempt, hashes=hashes, cost=cost, priority=priority, timeline=timeline,
                lora=lora)
            if request_id is not None:
                self.owner[request_id] = lease.member
            if timeline is not None:
                timeline.replica = lease.member.id
            yield first
            try:
                async for item in stream:
                    yield item
            except (ReplicaConnectionError, ReplicaStreamError) as exc:
                record_failure(lease.member, exc, self.spec, self.name,
                               before_first_byte=False)
                raise
        finally:
            if stream is not None:
                with contextlib.suppress(Exception):
                    await stream.aclose()  # type: ignore[attr-defined]
            if request_id is not None:
                self.owner.pop(request_id, None)
            if lease is not None:
                lease.release()
            self.inflight -= 1
            if self.demand is not None:  # its idle time starts as its last request ends
                self.demand.touch()

    async def call(self, attempt: Callable[[Member], Awaitable[_T]], *, cost: int = 1,
                   priority: int = 0, timeline: Timeline | None = None) -> _T:
        """One request/response call on the best member, with failover."""
        self.inflight += 1
        try:
            lease, result = await self.acquire(attempt, cost=cost, priority=priority,
                                               timeline=timeline)
            lease.release()
            return result
        finally:
            self.inflight -= 1
            if self.demand is not None:
                self.demand.touch()
