"""Engine replicas placed by Ray (issue 24 §1, §4), on a Ray cluster of three nodes on this
machine (`ray.cluster_utils.Cluster`): a head, and two nodes whose custom resources stand
for two hosts. The replicas are mock replicas (the replica protocol on a timer; the real
`tokenyard engine` is the same child of the actor, only slower to start), each the child
of its Ray actor; a pool finds them through the registry (`cli/ray_replicas.py`) as a
gateway does.

- Two replicas land one per host; requests spread over both. The node holding one is
  removed (its actor and replica die with it): requests go on on the other, Ray restarts
  the actor on the surviving host, and the pool admits the new replica.
- Scale 1 → 2 → 1 while requests run: none fails, and the one taken away drains first.

Bounded: the cluster starts once for the module (about 30 s on 2 busy cores)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from tests.conftest import require_service
from tests.integration.test_dns_discovery import _count
from tokenyard.balancer.discovery import Discovery
from tokenyard.balancer.pool import Pool
from tokenyard.balancer.replica_client import ReplicaClient
from tokenyard.deployments import BalancerSpec
from tokenyard.placement_spec import Autoscale, RayPlacement

pytestmark = pytest.mark.slow
MOCK = [sys.executable, "-m", "tokenyard.bench.mock_replica", "--itl-ms", "5",
        "--output-len", "8"]
#: Each "host" holds four replica slots: room for a restart and for the other tests.
PLACEMENT = RayPlacement(2, 1, 3, num_cpus=0, custom={"replica_slot": 1})
INTERVAL_S = 0.3


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        require_service("Ray", False, "ray is not installed (make venv installs the ray extra)")
        raise
    from tokenyard.cli import ray_replicas

    try:
        made = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "include_dashboard": False})
        hosts = [made.add_node(num_cpus=1, resources={"replica_slot": 4, f"host_{h}": 1})
                 for h in "ab"]
        made.wait_for_nodes()
    except Exception as exc:
        require_service("Ray", False, f"a local Ray cluster did not start: {exc!r}")
        raise
    try:
        ray_replicas.connect(RayPlacement(1, 1, 1, address=made.address))
        yield made, hosts
    finally:
        ray.shutdown()
        made.shutdown()


def _scale(name: str, count: int) -> list[int]:
    from tokenyard.cli import ray_replicas

    return asyncio.run(ray_replicas.scale(
        name, PLACEMENT, count, MOCK, None, start_timeout_s=60,
        discovery_interval_s=INTERVAL_S * 3, drain_timeout_s=10))


def _followed(name: str) -> tuple[Discovery, Pool]:
    from tokenyard.cli import ray_replicas

    found = Discovery(lambda: ray_replicas.urls(name), ReplicaClient, interval_s=INTERVAL_S)
    return found, Pool(name, [], BalancerSpec(policy="round_robin", health_interval_s=0.5))


async def _following(name: str) -> Pool:
    """A started pool whose members follow the deployment's registry, refreshed once."""
    found, pool = _followed(name)
    pool.members[:] = []
    found.attach(pool)
    pool.watchers.append(found)
    pool.start()
    await found.refresh()
    return pool


async def _until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.1)


async def _under_load(name: str, tokens: int, steps: Callable[[Pool], Awaitable[None]]) -> None:
    """Three clients send requests of `tokens` tokens without pause through a pool that
    follows the deployment while `steps` runs; then none may have failed or come short."""
    found, pool = _followed(name)
    found.attach(pool)
    pool.watchers.append(found)
    await found.refresh()
    stop = asyncio.Event()
    done: list[int] = []

    async def load(worker: int) -> None:
        i = 0
        while not stop.is_set():
            done.append(await _count(pool, f"w{worker}-{i}", tokens))
            i += 1

    workers = [asyncio.create_task(load(w)) for w in range(3)]
    try:
        await steps(pool)
        stop.set()
        await asyncio.gather(*workers)
    finally:
        stop.set()
        await pool.close()
    assert done and all(n == tokens for n in done)
    assert sum(m.failed for m in pool.members) == 0


def test_one_replica_per_host_then_a_host_dies_and_ray_restarts_it(cluster: Any) -> None:
    import ray

    made, hosts = cluster
    name = "spread"
    assert _scale(name, 2) == [0, 1]
    actors = [ray.get_actor(f"{name}/{i}", namespace="tokenyard") for i in range(2)]
    placed = ray.get([a.describe.remote() for a in actors])
    assert {p["node_id"] for p in placed} == {h.node_id for h in hosts}  # one per host
    victim = next(h for h in hosts if h.node_id == placed[1]["node_id"])

    async def scenario() -> None:
        pool = await _following(name)
        try:
            assert sorted(m.id for m in pool.members) == sorted(p["url"] for p in placed)
            assert await asyncio.gather(*(_count(pool, f"a{i}") for i in range(8))) == [8] * 8
            assert all(m.served for m in pool.members)  # spread over both hosts
            made.remove_node(victim)  # the host dies, with the actor and its replica
            # Requests go on: one on the dead replica fails over before its first byte.
            for i in range(6):
                assert await _count(pool, f"b{i}") == 8
            await _until(lambda: len(pool.members) == 2 and placed[1]["url"] not in
                         {m.id for m in pool.members}, 60, "the restarted replica joins")
            again = ray.get(actors[1].describe.remote())
            assert again["node_id"] == placed[0]["node_id"]  # on the surviving host
            await _until(lambda: all(m.healthy for m in pool.members), 10, "healthy")
            before = {m.id: m.served for m in pool.members}
            assert await asyncio.gather(*(_count(pool, f"c{i}") for i in range(8))) == [8] * 8
            assert all(m.served > before[m.id] for m in pool.members)
        finally:
            await pool.close()

    asyncio.run(scenario())
    _scale(name, 1)
    hosts.append(made.add_node(num_cpus=1, resources={"replica_slot": 4, "host_c": 1}))
    made.wait_for_nodes()  # a new host takes the dead one's place


def test_a_killed_engine_process_comes_back_under_its_actor(cluster: Any) -> None:
    """SIGKILL on the replica process alone (what the OOM killer does), its actor and
    node alive: the actor leaves the registry and exits, Ray restarts it, and its new
    replica joins the pool and serves (issue 40: it stayed gone)."""
    import ray

    name = "phoenix"
    assert _scale(name, 1) == [0]
    actor = ray.get_actor(f"{name}/0", namespace="tokenyard")
    first = ray.get(actor.describe.remote())

    async def scenario() -> None:
        pool = await _following(name)
        try:
            assert [m.id for m in pool.members] == [first["url"]]
            assert await _count(pool, "before") == 8
            os.kill(first["pid"], signal.SIGKILL)
            await _until(lambda: [m.id for m in pool.members] not in ([], [first["url"]]),
                         60, "the restarted replica joins under a new URL")
            await _until(lambda: all(m.healthy for m in pool.members), 10, "healthy")
            assert await asyncio.gather(*(_count(pool, f"after{i}") for i in range(4))) == [
                8] * 4
        finally:
            await pool.close()

    try:
        asyncio.run(scenario())
        again = ray.get(actor.describe.remote())
        assert again["pid"] != first["pid"] and again["url"] != first["url"]
    finally:
        ray.kill(actor, no_restart=True)


def test_scale_one_two_one_loses_no_request(cluster: Any) -> None:
    name = "scaled"
    assert _scale(name, 1) == [0]

    async def steps(pool: Pool) -> None:
        await asyncio.to_thread(_scale, name, 2)
        await _until(lambda: len(pool.members) == 2, 10, "the second replica joins")
        await _until(lambda: all(m.served for m in pool.members), 10, "both serve")
        await asyncio.to_thread(_scale, name, 1)
        await _until(lambda: len(pool.members) == 1, 10, "the second replica leaves")

    asyncio.run(_under_load(name, 16, steps))


def test_serve_places_a_real_engine_replica_on_ray_and_serves_through_it(
        cluster: Any) -> None:
    """`serve`'s own path (`FleetBuilder.served`): a fleet file's `placement = "ray"` deployment
    gets its first replica placed as an actor running the real `tokenyard engine` (the
    embedded model), found through the registry, and a request generates through it."""
    import ray

    from tokenyard.cli.fleet import FleetBuilder
    from tokenyard.config import ServeConfig, default_cache_dir
    from tokenyard.deployments import parse_fleet
    from tokenyard.wire.sampling_params import SamplingParams

    name = "embedded"
    fleet_spec = parse_fleet({"balancer": {"discovery_interval_s": INTERVAL_S}, "deployments": [
        {"name": name, "placement": "ray", "replicas": 1, "engine_args": ["--threads", "1"],
         "resources": {"num_cpus": 0, "custom": {"replica_slot": 1}}}]})
    config = ServeConfig.from_env(replica_token="ray-test-token", replica_start_timeout_s=240)

    async def unused_starter(*_: Any) -> Any:
        raise AssertionError("a Ray-placed deployment starts no local child")

    async def scenario() -> tuple[int, float]:
        fleet = FleetBuilder(fleet_spec, unused_starter, config, default_cache_dir())
        served = await fleet.served(fleet_spec.deployments[name])
        try:
            assert not fleet.children
            (member,) = served.pool.members
            placed = ray.get(ray.get_actor(f"{name}/0", namespace="tokenyard")
                             .describe.remote())
            assert member.id == placed["url"]
            count = 0
            async for delta in served.pool.generate(
                    "r1", list(range(100, 120)), SamplingParams(max_tokens=4, ignore_eos=True)):
                count += len(delta.new_token_ids)
            return count, placed["start_s"]
        finally:
            await served.pool.close()

    try:
        count, start_s = asyncio.run(scenario())
        assert count == 4
        print(f"replica start under Ray (actor created -> listening): {start_s:.1f} s")
    finally:
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(f"{name}/0", namespace="tokenyard"), no_restart=True)


def test_autoscaler_grows_under_load_and_shrinks_after_without_a_failed_request(
        cluster: Any) -> None:
    """The autoscaler actor (`cli/ray_autoscale.py`): 3 requests at once on one replica
    with a target of 1 each → 2 replicas (the most allowed); idle after the cooldown →
    back to 1, draining."""
    import ray

    from tokenyard.cli import ray_autoscale

    name = "auto"
    rule = Autoscale(target_work=1, interval_s=INTERVAL_S, cooldown_s=1)
    placement = dataclasses.replace(PLACEMENT, replicas=1, max_replicas=2, autoscale=rule)
    assert _scale(name, 1) == [0]
    timeouts = {"start_timeout_s": 60.0, "discovery_interval_s": INTERVAL_S * 3,
                "drain_timeout_s": 10.0}
    autoscaler = ray_autoscale.start(name, placement, MOCK, None, timeouts)

    async def steps(pool: Pool) -> None:
        await _until(lambda: len(pool.members) == 2, 30, "the autoscaler adds one")
        # The load stops when this returns: then it is taken away again.

    try:
        asyncio.run(_under_load(name, 100, steps))
        asyncio.run(_shrinks_to_one(name))
        assert ray.get(autoscaler.history.remote()) == [(1, 2), (2, 1)]
    finally:
        ray.kill(autoscaler, no_restart=True)


async def _shrinks_to_one(name: str) -> None:
    from tokenyard.cli import ray_replicas

    async def one() -> bool:
        return len(await ray_replicas.urls(name)) == 1

    deadline = time.monotonic() + 30
    while not await one():
        assert time.monotonic() < deadline, "the autoscaler did not take the replica away"
        await asyncio.sleep(0.2)
