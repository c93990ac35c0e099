"""Stage 12: one deployment's replicas behind one object — health, selection, failover.

- **Members** are clients of one kind (`balancer/member_clients.py`: engine replicas,
  upstreams, embeddings replicas), each tracked as a `Member` (`balancer/members.py`).
- **Health**: each replica's health route is polled (`health_interval_s`); failures eject
  it for a while (`balancer/health.py`).
- **Selection**: the pool's `Policy` (`balancer/policy.py`, named by the fleet file's
  `balancer.policy`: `affinity`, `least`, `round_robin`, or one registered there) ranks
  the replicas that may take work; the pool tries them in that order.
- **Failover and the queue** (`balancer/failover.py`, `balancer/wait_queue.py`): a
  request is tried on the next replica until its first byte; when every available
  replica is "full" it waits by priority, then arrival.

The kinds' entry points: an engine replica's (`generate`, `stop`, `abort`, `stats`,
`info`: the pool is itself a `Replica`), an upstream's (`open_chat`, `open_completion`)
and an embeddings replica's (`call`, `embeddings_model`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from tokenyard.balancer.affinity import AffinityTable, LocalAffinity
from tokenyard.balancer.embeddings_client import EmbeddingsModel
from tokenyard.balancer.failover import Failover
from tokenyard.balancer.health import HealthChecks
from tokenyard.balancer.lora_homes import LoraHomes
from tokenyard.balancer.member_clients import (
    EmbeddingsMember,
    MemberClient,
    embeddings_of,
    engine_of,
    upstream_of,
)
from tokenyard.balancer.members import Lease, Member
from tokenyard.balancer.on_demand import OnDemand
from tokenyard.balancer.policy import Policy, RequestFacts, make_policy
from tokenyard.balancer.replica_client import ReplicaConnectionError, ReplicaError
from tokenyard.balancer.wait_queue import WaitQueue
from tokenyard.deployments import BalancerSpec
from tokenyard.lora_spec import lora_salt
from tokenyard.telemetry.timeline import Timeline
from tokenyard.wire.abort import AbortReport
from tokenyard.wire.outputs import EngineStats
from tokenyard.wire.protocol import CoreDelta
from tokenyard.wire.replica_info import ReplicaInfo, ReplicaStats
from tokenyard.wire.sampling_params import SamplingParams

_T = TypeVar("_T")


class Watcher(Protocol):
    """What changes a pool's members and stops with it (`balancer/discovery.Discovery`)."""

    async def close(self) -> None:
        ...


class Pool:
    """One deployment's replicas (see the module's docstring)."""

    #: `Generation` passes its timeline to `generate` (the `balance` stage).
    takes_timeline = True

    def __init__(
        self,
        name: str,
        members: Sequence[tuple[str, MemberClient]],
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
        self._model: EmbeddingsModel | None = None
        self.failover = Failover(name, self.spec, self._order, self.policy.placed)
        self.checks = HealthChecks(name, self.spec, lambda: self.members,
                                   forget=self._forget, wake=self.failover.wake)
        self._memo: tuple[int, int, str | None, list[int]] = (0, -1, None, [])
        #: What changes the members and stops with the pool (`balancer/discovery.py`).
        self.watchers: list[Watcher] = []
        #: Where each LoRA adapter's requests went last (`balancer/lora_homes.py`).
        self.lora_homes = LoraHomes()
        self.failover.served_lora = self.lora_homes.served

    @property
    def inflight(self) -> int:
        """Requests of this pool in flight."""
        return self.failover.inflight

    @property
    def decisions(self) -> int:
        """Decisions taken (their time is each request's `balance` stage)."""
        return self.failover.decisions

    @property
    def demand(self) -> OnDemand | None:
        """Its model's load state when it is loaded on demand (`balancer/on_demand.py`)."""
        return self.failover.demand

    def load_on_demand(self, demand: OnDemand) -> None:
        """Its replicas start on its first request and stop when idle, as `demand` says."""
        self.failover.demand = demand
        demand.attach(self, self.failover.waiting)

    @property
    def _owner(self) -> dict[str, Member]:
        return self.failover.owner

    @property
    def _waiting(self) -> WaitQueue:
        return self.failover.waiting

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Begin polling health (idempotent)."""
        self.checks.start(self._with_stats)
        if self.tracks_prefixes:  # `precise`: the replicas' KV events
            self.policy.watch(self.members)

    async def stop_health(self) -> None:
        """Stop polling health (at shutdown draining replicas answer 503: no failure)."""
        await self.checks.stop()

    async def close(self) -> None:
        if self.demand is not None:
            await self.demand.close()
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

    def _forget(self, member_id: str) -> None:
        """Drop the prefixes a member held (it may have restarted with an empty cache)."""
        forget = getattr(self.affinity, "forget", None)
        if forget is not None:
            forget(member_id)

    def _with_stats(self) -> bool:
        """Probes read the engine figures too: an engine's pool (its model is known)."""
        return isinstance(self.info_cache, ReplicaInfo)

    async def check_health(self) -> None:
        """One round of health checks (also each tick of the loop)."""
        await self.checks.check(self._with_stats())

    async def health(self) -> bool:
        """Whether a replica may take work now (checked now, not at the last tick)."""
        await self.check_health()
        now = time.monotonic()
        if self.demand is not None and self.demand.state != "loaded":
            return True  # its first request loads it
        return any(m.available(now) for m in self.members)

    # ------------------------------------------------------------------ admin
    def drain(self, member_id: str, draining: bool = True) -> bool:
        """Stop (or resume) sending new work to a member; running requests go on."""
        return self.checks.drain(member_id, draining)

    @property
    def queued(self) -> int:
        """Requests waiting here for a replica with room (the full-pool queue)."""
        return len(self.failover.waiting)

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
        order = await self.policy.order(avail, facts)
        return order if facts.lora is None else self.lora_homes.first(order, facts.lora)

    async def acquire(
        self, attempt: Callable[[Member], Awaitable[_T]], *, hashes: Sequence[int] = (),
        cost: int = 1, priority: int = 0, timeline: Timeline | None = None,
    ) -> tuple[Lease, _T]:
        """`Failover.acquire` over this pool's members."""
        return await self.failover.acquire(attempt, hashes=hashes, cost=cost,
                                           priority=priority, timeline=timeline)

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
        gets the decision's time as its `balance` stage). A request of a LoRA adapter
        (`extra["lora"]`) hashes its prompt as the replica keys its blocks (salted by the
        adapter), and goes where the adapter was sent last (`LoraHomes`) when that
        replica is not much busier."""
        lora = extra.get("lora")
        salt = lora_salt(cache_salt, lora)
        stream = self.failover.stream(
            lambda m: engine_of(m.client).generate(
                request_id, prompt_token_ids, params, cache_salt, priority, **extra),
            hashes=self.hashes(prompt_token_ids, salt),
            cost=len(prompt_token_ids) + (params.max_tokens or 0),
            priority=priority, request_id=request_id, timeline=timeline, lora=lora,
        )
        if not self.policy.follows_output or not self.tracks_prefixes:
            return stream
        return self._remember_output(stream, request_id, prompt_token_ids, salt)

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
            await engine_of(member.client).stop(request_id, stop)

    async def abort(self, request_id: str) -> AbortReport | None:
        member = self._owner.get(request_id)
        return await engine_of(member.client).abort(request_id) if member is not None else None

    async def stats(self) -> ReplicaStats:
        """The pool's engine figures, summed over the replicas that answer (all zero for
        an on-demand model with none loaded)."""
        if not self.members and self.demand is not None:
            return EngineStats(**dict.fromkeys(EngineStats.__dataclass_fields__, 0))
        found = [s for s in await asyncio.gather(
            *(engine_of(m.client).stats() for m in self.members), return_exceptions=True)
            if isinstance(s, EngineStats)]
        if not found:
            raise ReplicaConnectionError(f"no replica of {self.name} answered its stats")
        return EngineStats.summed(found)

    async def info(self) -> ReplicaInfo:
        """The engine's model facts, asked of the first replica that answers, then kept."""
        if self.info_cache is None:
            self.info_cache = await self._first_answer(lambda m: engine_of(m.client).info())
        return self.info_cache

    async def load_lora(self, name: str, path: str) -> None:
        """Every replica serves LoRA adapter `name` from `path` (a ReplicaError from the
        first that cannot; those before it keep it, unused until it is listed)."""
        for member in self.members:
            load = getattr(engine_of(member.client), "load_lora", None)
            if load is None:
                raise ReplicaConnectionError(f"replica {member.id} of {self.name} cannot "
                                             "load LoRA adapters at run time")
            await load(name, path)

    async def unload_lora(self, name: str) -> None:
        """No replica serves adapter `name` any more (those that do not are skipped)."""
        for member in self.members:
            unload = getattr(engine_of(member.client), "unload_lora", None)
            if unload is not None:
                with contextlib.suppress(ReplicaError):
                    await unload(name)

    async def _first_answer(self, ask: Callable[[Member], Awaitable[_T]]) -> _T:
        for member in self.members:
            with contextlib.suppress(ReplicaError):
                return await ask(member)
        raise ReplicaConnectionError(f"no replica of {self.name} answered")

    # ------------------------------------------------------------------ upstreams
    def open_chat(self, body: Mapping[str, Any], *, cost: int = 1, priority: int = 0,
                  timeline: Timeline | None = None) -> AsyncIterator[dict[str, Any]]:
        """An upstream's chat stream (OpenAI chunks), opened with failover."""
        return self.failover.stream(lambda m: upstream_of(m.client).open_chat(body),
                                    cost=cost, priority=priority, timeline=timeline)

    def open_completion(self, body: Mapping[str, Any], *, cost: int = 1, priority: int = 0,
                        timeline: Timeline | None = None) -> AsyncIterator[dict[str, Any]]:
        """An upstream's completions stream, opened with failover."""
        return self.failover.stream(lambda m: upstream_of(m.client).open_completion(body),
                                    cost=cost, priority=priority, timeline=timeline)

    # ------------------------------------------------------------------ embeddings
    async def call(self, fn: Callable[[EmbeddingsMember], Awaitable[_T]], *, cost: int = 1,
                   priority: int = 0, timeline: Timeline | None = None) -> _T:
        """One request/response call (embeddings) on the best member, with failover."""
        return await self.failover.call(lambda m: fn(embeddings_of(m.client)), cost=cost,
                                        priority=priority, timeline=timeline)

    async def embeddings_model(self) -> EmbeddingsModel:
        """The embeddings model and its tokenizer, asked of the first replica that
        answers, then kept."""
        if self._model is None:
            self._model = await self._first_answer(lambda m: embeddings_of(m.client).info())
        return self._model
