"""Stage 12: one deployment's replicas behind one object — health, selection, failover.

- **Health**: each replica's health route is polled (`health_interval_s`); failures eject
  it for a while (`balancer/members.py` keeps that account).
- **Selection**: the pool's `Policy` (`balancer/policy.py`, named by the fleet file's
  `balancer.policy`: `affinity`, `least`, `round_robin`, or one registered there) ranks
  the replicas that may take work; the pool tries them in that order.
- **Failover**: a request that has not received its first byte is tried on the next
  replica (each at most once); one that has, ends with the error (the caller's stream
  gets a clean error event). A replica that answers "draining" is skipped the same way.
- **Queue**: when every available replica is "full", the request waits here by priority,
  then arrival (`balancer/wait_queue.py`), up to `queue_timeout_s`, woken as a request
  of this pool ends; then, or when `queue_max` already wait, 503 with retry-after.

One mechanism (`_stream`) serves engine replicas (the pool is itself a `Replica`),
upstreams (`open_chat`, `open_completion`) and embeddings replicas (`call`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from tokenyard.balancer.affinity import AffinityTable, LocalAffinity
from tokenyard.balancer.members import (
    SILENT_PROBES_TO_CUT,
    SILENT_PROBES_TO_UNHEALTHY,
    Lease,
    Member,
    probe,
    record_failure,
    record_success,
)
from tokenyard.balancer.policy import Policy, RequestFacts, make_policy
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
from tokenyard.wire.abort import AbortReport
from tokenyard.wire.outputs import EngineStats
from tokenyard.wire.protocol import CoreDelta
from tokenyard.wire.replica_info import ReplicaInfo, ReplicaStats
from tokenyard.wire.sampling_params import SamplingParams

logger = logging.getLogger("tokenyard.balancer")

_T = TypeVar("_T")


class Pool:
    """One deployment's replicas (see the module's docstring)."""

    #: `Generation` passes its timeline to `generate` (the `balance` stage).
    takes_timeline = True

    def __init__(
        self,
        name: str,
        members: Sequence[tuple[str, Any]],
        spec: BalancerSpec | None = None,
        *,
        affinity: AffinityTable | None = None,
        block_size: int = 16,
        info: ReplicaInfo | None = None,
    ) -> None:
        self.name = name
        self.spec = spec or BalancerSpec()
        self.members = [Member(mid, client) for mid, client in members]
        self.affinity: AffinityTable = affinity or LocalAffinity(self.spec.affinity_entries)
        self.block_size = block_size
        #: Chosen once by name (ValueError for an unknown one; the fleet file's parse
        #: already refused it).
        self.policy: Policy = make_policy(self.spec.policy, self.affinity, block_size)
        self.info_cache = info
        self._waiting = WaitQueue()
        self._owner: dict[str, Member] = {}
        self._health_task: asyncio.Task[None] | None = None
        self._memo: tuple[int, int, str | None, list[int]] = (0, -1, None, [])
        self.inflight = 0
        #: Decisions taken and how long they took (ns), for the `balance` stage.
        self.decisions = 0
        #: What changes the members and stops with the pool (`balancer/discovery.py`).
        self.watchers: list[Any] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Begin polling health (idempotent)."""
        if self._health_task is None and self.spec.health_interval_s > 0:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        if self.tracks_prefixes:  # `precise`: the replicas' KV events
            self.policy.watch(self.members)

    async def stop_health(self) -> None:
        """Stop polling health (at shutdown draining replicas answer 503: no failure)."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(BaseException):
                await self._health_task
            self._health_task = None

    async def close(self) -> None:
        for watcher in self.watchers:
            await watcher.close()
        await self.stop_health()
        await self.policy.close()
        for member in self.members:
            with contextlib.suppress(Exception):
                await member.client.close()

    async def wait_idle(self, timeout: float) -> None:
        """Wait until no request of this pool is in flight (a removed deployment drains)."""
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def check_health(self) -> None:
        """One round of health checks (also each tick of the loop)."""
        with_stats = isinstance(self.info_cache, ReplicaInfo)
        results = await asyncio.gather(*(probe(m, self.spec, with_stats) for m in self.members))
        for member, (ok, stats) in zip(self.members, results, strict=True):
            if not ok and 0 < member.silent < SILENT_PROBES_TO_UNHEALTHY:
                ok = member.healthy  # one probe without an answer: busy, not yet sick
            if ok and not member.healthy:
                logger.info("replica %s of %s is healthy again", member.id, self.name,
                            extra={"event": "replica_readmitted", "replica": member.id,
                                   "deployment": self.name})
                forget = getattr(self.affinity, "forget", None)
                if forget is not None:  # it may have restarted with an empty cache
                    forget(member.id)
            elif not ok and member.healthy:
                logger.warning("replica %s of %s failed its health check", member.id,
                               self.name, extra={"event": "replica_unhealthy",
                                                 "replica": member.id, "deployment": self.name})
            member.healthy = ok
            if stats is not None:
                member.stats = stats
            if member.silent == SILENT_PROBES_TO_CUT:
                # Unreachable (a partition: not a drain, not a refusal). Its open requests
                # would wait for it indefinitely; closing its connections fails over those
                # before their first byte and ends the others with an error.
                logger.warning("replica %s of %s does not answer; closing its connections",
                               member.id, self.name, extra={
                                   "event": "replica_silent", "replica": member.id,
                                   "deployment": self.name})
                with contextlib.suppress(Exception):
                    await member.client.close()
        self._wake()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.spec.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # never let the loop die
                logger.exception("health checks of %s failed", self.name)

    # ------------------------------------------------------------------ admin
    def drain(self, member_id: str, draining: bool = True) -> bool:
        """Stop (or resume) sending new work to a member; running requests go on."""
        for member in self.members:
            if member.id == member_id:
                member.draining = draining
                logger.info("replica %s of %s %s", member_id, self.name,
                            "draining" if draining else "back in service", extra={
                                "event": "replica_drain" if draining else "replica_undrain",
                                "replica": member_id, "deployment": self.name})
                return True
        return False

    @property
    def queued(self) -> int:
        """Requests waiting here for a replica with room (the full-pool queue)."""
        return len(self._waiting)

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{**m.snapshot(now), **self.policy.describe(m.id)} for m in self.members]

    # ------------------------------------------------------------------ selection
    @property
    def tracks_prefixes(self) -> bool:
        """Whether prefix placements can matter: the pool has several members, or its
        table is shared (Redis: other gateways route by it). One member behind a table
        of this process's own has nothing to choose between: no hashing, no records."""
        return len(self.members) > 1 or not isinstance(self.affinity, LocalAffinity)

    def hashes(self, prompt: Sequence[int], salt: str | None) -> list[int]:
        """The prompt's block hashes (memoised for the n children of one prompt); none
        where they cannot matter (`tracks_prefixes`)."""
        if not self.tracks_prefixes:
            return []
        key = (id(prompt), len(prompt), salt)
        if self._memo[:3] != key:
            self._memo = (*key, self.policy.prompt_hashes(prompt, self.block_size, salt))
        return self._memo[3]

    @property
    def affinity_hits(self) -> int:
        """Decisions the prefix affinity changed (0 under another policy)."""
        return self.policy.hits

    async def _order(self, facts: RequestFacts, exclude: set[str]) -> list[Member]:
        now = time.monotonic()
        avail = [m for m in self.members if m.id not in exclude and m.available(now)]
        if len(avail) <= 1:
            return avail
        return await self.policy.order(avail, facts)

    # ------------------------------------------------------------------ failover
    async def acquire(
        self,
        attempt: Callable[[Member], Awaitable[_T]],
        *,
        hashes: Sequence[int] = (),
        cost: int = 1,
        priority: int = 0,
        timeline: Timeline | None = None,
    ) -> tuple[Lease, _T]:
        """Run `attempt` on the best member, failing over before the first byte; wait in
        the queue when every member is full. Returns the lease (release it when the
        request ends) and what `attempt` returned. The decisions' own time is the
        timeline's `balance` stage."""
        deadline = time.monotonic() + self.spec.queue_timeout_s
        facts = RequestFacts(hashes, cost, priority)
        tried: set[str] = set()
        arrival = self._waiting.arrival()  # kept through every wait: FIFO in a class
        waited = False
        while True:
            if self._waiting.ahead(priority, arrival):
                if waited:  # woken, but an earlier or more urgent request waits: its turn
                    self._waiting.wake()
                await self._waiting.wait(priority, arrival, deadline, 1.0,
                                         self.spec.queue_max, self.name)
                waited = True
                continue
            self.decisions += 1
            began = time.perf_counter_ns()
            order = await self._order(facts, tried)
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
                if hashes:
                    await self.policy.placed(hashes, member)
                if waited:  # there may be room for the next in line too
                    self._waiting.wake()
                return lease, result
            if full is None:
                raise last or ReplicaConnectionError(
                    f"no replica of {self.name} is available")
            await self._waiting.wait(priority, arrival, deadline, full.retry_after or 1.0,
                                     self.spec.queue_max, self.name)
            waited = True
            tried.clear()  # everyone may have room now

    def _lease(self, member: Member, cost: int) -> Lease:
        member.inflight += 1
        member.inflight_tokens += cost
        return Lease(self, member, cost)

    def _wake(self) -> None:
        """Let the first waiting request (by priority) try again."""
        self._waiting.wake()

    async def _stream(
        self,
        open_fn: Callable[[Member], AsyncIterator[_T]],
        *,
        hashes: Sequence[int] = (),
        cost: int = 1,
        priority: int = 0,
        request_id: str | None = None,
        timeline: Timeline | None = None,
    ) -> AsyncIterator[_T]:
        """A member's stream, opened with failover; its first item is read before the
        member is chosen for good. Closing it closes the member's stream."""
        self.inflight += 1
        lease: Lease | None = None
        stream: AsyncIterator[_T] | None = None
        try:
            async def attempt(member: Member) -> tuple[AsyncIterator[_T], _T]:
                if request_id is not None:  # `abort` reaches it before its first item too
                    self._owner[request_id] = member
                it = open_fn(member)
                try:
                    return it, await it.__anext__()
                except BaseException:
                    with contextlib.suppress(Exception):
                        await it.aclose()  # type: ignore[attr-defined]
                    raise

            lease, (stream, first) = await self.acquire(
                attempt, hashes=hashes, cost=cost, priority=priority, timeline=timeline)
            if request_id is not None:
                self._owner[request_id] = lease.member
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
                self._owner.pop(request_id, None)
            if lease is not None:
                lease.release()
            self.inflight -= 1

    # ------------------------------------------------------------------ engine replicas
    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        timeline: Timeline | None = None,
        **extra: Any,
    ) -> AsyncIterator[CoreDelta]:
        """`Replica.generate` over the pool: the best replica for this prompt (`timeline`
        gets the decision's time as its `balance` stage)."""
        stream = self._stream(
            lambda m: m.client.generate(request_id, prompt_token_ids, params, cache_salt,
                                        priority, **extra),
            hashes=self.hashes(prompt_token_ids, cache_salt),
            cost=len(prompt_token_ids) + (params.max_tokens or 0),
            priority=priority, request_id=request_id, timeline=timeline,
        )
        if not self.policy.follows_output or not self.tracks_prefixes:
            return stream
        return self._remember_output(stream, request_id, prompt_token_ids, cache_salt)

    async def _remember_output(
        self, stream: AsyncIterator[CoreDelta], request_id: str, prompt: list[int],
        salt: str | None,
    ) -> AsyncIterator[CoreDelta]:
        """Pass the deltas on; once the request finished, record that its replica also
        holds the prompt followed by the output (a conversation's next turn starts so)."""
        output: list[int] = []
        member: Member | None = None
        try:
            async for delta in stream:
                if member is None:
                    member = self._owner.get(request_id)
                output.extend(getattr(delta, "new_token_ids", ()))
                yield delta
                reason = getattr(delta, "finish_reason", None)
                if reason is not None and reason != "abort":
                    if member is not None and output:
                        held = self.policy.prompt_hashes(prompt + output, self.block_size, salt)
                        await self.policy.placed(held, member)
                    return
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def stop(self, request_id: str, stop: str) -> None:
        member = self._owner.get(request_id)
        if member is not None:
            await member.client.stop(request_id, stop)

    async def abort(self, request_id: str) -> AbortReport | None:
        member = self._owner.get(request_id)
        return await member.client.abort(request_id) if member is not None else None

    async def stats(self) -> ReplicaStats:
        """The pool's engine figures, summed over the replicas that answer."""
        found = [s for s in await asyncio.gather(
            *(m.client.stats() for m in self.members), return_exceptions=True)
            if isinstance(s, EngineStats)]
        if not found:
            raise ReplicaConnectionError(f"no replica of {self.name} answered its stats")
        return EngineStats.summed(found)

    async def info(self) -> ReplicaInfo:
        if self.info_cache is None:
            for member in self.members:
                with contextlib.suppress(ReplicaError):
                    self.info_cache = await member.client.info()
                    break
            else:
                raise ReplicaConnectionError(f"no replica of {self.name} answered")
        return self.info_cache

    async def health(self) -> bool:
        """Whether a replica may take work now (checked now, not at the last tick)."""
        await self.check_health()
        now = time.monotonic()
        return any(m.available(now) for m in self.members)

    # ------------------------------------------------------------------ upstreams, embeddings
    def open_chat(self, body: Mapping[str, Any], *, cost: int = 1, priority: int = 0,
                  timeline: Timeline | None = None) -> AsyncIterator[dict[str, Any]]:
        """An upstream's chat stream (OpenAI chunks), opened with failover."""
        return self._stream(lambda m: m.client.open_chat(body), cost=cost, priority=priority,
                            timeline=timeline)

    def open_completion(self, body: Mapping[str, Any], *, cost: int = 1, priority: int = 0,
                        timeline: Timeline | None = None) -> AsyncIterator[dict[str, Any]]:
        """An upstream's completions stream, opened with failover."""
        return self._stream(lambda m: m.client.open_completion(body), cost=cost,
                            priority=priority, timeline=timeline)

    async def call(self, fn: Callable[[Any], Awaitable[_T]], *, cost: int = 1,
                   priority: int = 0, timeline: Timeline | None = None) -> _T:
        """One request/response call (embeddings) on the best member, with failover."""
        self.inflight += 1
        try:
            lease, result = await self.acquire(lambda m: fn(m.client), cost=cost,
                                               priority=priority, timeline=timeline)
            lease.release()
            return result
        finally:
            self.inflight -= 1
