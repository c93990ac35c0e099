"""Models on demand (`balancer/on_demand.py`) over in-process members: the first request
starts the load and every request during it waits for that one load; a load that fails
fails its waiters and the next request tries again; a load expected to outlast the wait
is refused at once with retry-after; unloading takes the members out at once and stops
the replicas only after their requests ended; idle models unload, pinned ones never;
the host's budget unloads the least recently used unpinned model, and refuses a load
when only pinned ones are resident. No timed assertions: the tests wait for states."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

import pytest

from tests.unit.test_pool import PROMPT, FakeReplica
from tokenyard.balancer.member_clients import MemberClient
from tokenyard.balancer.on_demand import ModelHost, OnDemand
from tokenyard.balancer.pool import Pool
from tokenyard.balancer.replica_client import ReplicaOverloaded
from tokenyard.deployments import BalancerSpec
from tokenyard.load_spec import OnDemandSpec
from tokenyard.wire.sampling_params import SamplingParams


def in_loop(fn: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """A test body run in its own event loop."""
    def test() -> None:
        asyncio.run(fn())
    test.__name__ = fn.__name__
    return test


class Replicas:
    """What starts and stops a model's fake replicas, and what it was asked."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.starts = 0
        self.stopped: list[str] = []
        self.gate: asyncio.Event | None = None  # the start waits for it when set
        self.fail: Exception | None = None
        self.live: list[FakeReplica] = []

    async def start(self) -> Sequence[tuple[str, MemberClient]]:
        self.starts += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        replica = FakeReplica(f"{self.name}-{self.starts}")
        self.live.append(replica)
        return [(replica.name, cast(MemberClient, replica))]

    async def stop(self, ids: Sequence[str]) -> None:
        self.stopped.extend(ids)


def on_demand(name: str = "dep", host: ModelHost | None = None, **spec: Any,
              ) -> tuple[Pool, OnDemand, Replicas]:
    replicas = Replicas(name)
    pool = Pool(name, [], BalancerSpec(health_interval_s=0, queue_timeout_s=5))
    demand = OnDemand(name, OnDemandSpec(**spec), replicas.start, replicas.stop, host)
    pool.load_on_demand(demand)
    return pool, demand, replicas


async def ask(pool: Pool, rid: str = "r") -> list[Any]:
    return [d async for d in pool.generate(rid, PROMPT, SamplingParams(max_tokens=3))]


async def until(condition: Any) -> None:
    """Wait (bounded) until `condition()` holds."""
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0.01)


@in_loop
async def test_first_request_loads_once_and_a_burst_waits_for_it() -> None:
    pool, demand, replicas = on_demand()
    assert demand.state == "unloaded" and pool.members == []
    replicas.gate = asyncio.Event()
    burst = [asyncio.create_task(ask(pool, f"r{i}")) for i in range(20)]
    await until(lambda: demand.state == "loading" and len(pool.failover.waiting) == 20)
    replicas.gate.set()
    answers = await asyncio.gather(*burst)
    assert all(len(a) == 3 for a in answers)
    assert replicas.starts == 1 and demand.state == "loaded" and demand.loads == 1
    assert pool.inflight == 0 and all(m.inflight == 0 for m in pool.members)


@in_loop
async def test_a_failed_load_fails_its_waiters_and_the_next_request_loads_again() -> None:
    pool, demand, replicas = on_demand()
    replicas.fail = RuntimeError("the engine exited with code 1")
    results = await asyncio.gather(*(ask(pool, f"r{i}") for i in range(3)),
                                   return_exceptions=True)
    assert all(isinstance(r, ReplicaOverloaded) and r.code == "model_load_failed"
               for r in results)
    assert demand.state == "unloaded" and "code 1" in (demand.error or "")
    assert not demand.holds_slot and pool.inflight == 0
    replicas.fail = None
    assert len(await ask(pool)) == 3
    assert replicas.starts == 2 and demand.state == "loaded" and demand.error is None


@in_loop
async def test_a_load_expected_to_outlast_the_wait_is_refused_with_retry_after() -> None:
    pool, demand, replicas = on_demand(load_timeout_s=2)
    demand.load_times.append(120.0)  # the last load took two minutes
    replicas.gate = asyncio.Event()
    with pytest.raises(ReplicaOverloaded) as refused:
        await ask(pool)
    assert refused.value.code == "model_loading"
    assert refused.value.retry_after is not None and refused.value.retry_after >= 100
    assert demand.state == "loading"  # the load goes on for later requests
    replicas.gate.set()
    await until(lambda: demand.state == "loaded")
    assert pool.inflight == 0


@in_loop
async def test_unload_never_cuts_a_running_request() -> None:
    pool, demand, replicas = on_demand()
    await ask(pool)
    replica = replicas.live[0]
    replica.gate = asyncio.Event()
    stream = pool.generate("long", PROMPT, SamplingParams(max_tokens=3))
    first = await stream.__anext__()
    unloading = asyncio.create_task(demand.unload())
    await until(lambda: demand.state == "unloading")
    assert pool.members == []  # no new request can pick it up
    await asyncio.sleep(0.05)
    assert replicas.stopped == [] and not unloading.done()  # still running: not stopped
    replica.gate.set()
    rest = [d async for d in stream]
    assert [first, *rest] == [f"{replica.name}:long:{i}" for i in range(3)]
    assert await unloading is True
    assert replicas.stopped == [replica.name] and demand.state == "unloaded"
    assert replica.closed and not demand.holds_slot


@in_loop
async def test_idle_models_unload_and_the_next_request_loads_again() -> None:
    pool, demand, replicas = on_demand(idle_unload_s=0.05)
    await ask(pool)
    await until(lambda: demand.state == "unloaded")
    assert replicas.stopped == ["dep-1"] and demand.unloads == 1
    await ask(pool)
    assert replicas.starts == 2 and demand.state == "loaded"
    await demand.close()
    assert replicas.stopped == ["dep-1", "dep-2"]


@in_loop
async def test_pinned_models_are_not_unloaded_when_idle() -> None:
    pool, demand, replicas = on_demand(idle_unload_s=0.02, pinned=True)
    await ask(pool)
    for _ in range(10):  # several idle periods go by
        await asyncio.sleep(0.02)
    assert demand.state == "loaded" and replicas.stopped == []
    demand.pinned = False
    await until(lambda: demand.state == "unloaded")
    assert replicas.stopped == ["dep-1"]


@in_loop
async def test_the_host_budget_unloads_the_least_recently_used_model() -> None:
    host = ModelHost(2)
    models = {name: on_demand(name, host) for name in ("a", "b", "c")}
    await ask(models["a"][0])
    await ask(models["b"][0])
    await ask(models["a"][0])  # a used after b: b is the least recently used
    await ask(models["c"][0])
    assert [models[n][1].state for n in "abc"] == ["loaded", "unloaded", "loaded"]
    assert models["b"][2].stopped == ["b-1"] and models["a"][2].stopped == []
    assert len(host.resident()) == 2


@in_loop
async def test_pinned_models_keep_their_slot_and_a_load_without_room_fails() -> None:
    host = ModelHost(1)
    pool_a, a, _ = on_demand("a", host, pinned=True)
    pool_b, b, replicas_b = on_demand("b", host)
    await ask(pool_a)
    with pytest.raises(ReplicaOverloaded):
        await ask(pool_b)
    assert a.state == "loaded" and b.state == "unloaded" and replicas_b.starts == 0
    assert "none may be unloaded" in (b.error or "")
    a.pinned = False
    assert len(await ask(pool_b)) == 3
    assert a.state == "unloaded" and b.state == "loaded"


@in_loop
async def test_requests_waiting_for_a_load_go_by_priority_class_then_arrival() -> None:
    pool, _, replicas = on_demand()
    replicas.gate = asyncio.Event()

    async def one(rid: str, priority: int) -> None:
        params = SamplingParams(max_tokens=3)
        assert len([d async for d in pool.generate(rid, PROMPT, params,
                                                   priority=priority)]) == 3

    tasks = []
    for rid, priority in (("low-1", 2), ("normal-1", 1), ("low-2", 2), ("high-1", 0),
                          ("normal-2", 1)):
        tasks.append(asyncio.create_task(one(rid, priority)))
        waiting = len(tasks)
        await until(lambda: len(pool.failover.waiting) == waiting)  # noqa: B023
    replicas.gate.set()
    await asyncio.gather(*tasks)
    assert replicas.live[0].calls == ["high-1", "normal-1", "normal-2", "low-1", "low-2"]
