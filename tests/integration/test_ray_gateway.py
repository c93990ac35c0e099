"""Ray-placed replicas through a real gateway (issue 24 §1, §4): `tokenyard serve --config`
with a `placement = "ray"` deployment of real `tokenyard engine --threads 1` replicas on
the three-node Ray cluster of tests/integration/test_ray_placement.py (a head and two
"hosts"), the gateway on (keys, the ledger in its SQLite file).

- Scaling through the admin route, `POST /admin/v1/deployments/{name}/replicas`, 1 → 2 → 1
  while clients send requests without pause: none fails; a bad count, an unknown
  deployment and one not placed by Ray are refused in the admin API's error shape.
- The node holding one of two replicas is removed while streams run on both: requests
  without a first byte succeed on the other replica, the streams on the dead one end with
  an error event, Ray restarts the actor on the surviving node and the gateway's pool
  re-admits it; the ledger has one row per request that produced tokens and no other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.conftest import Server, running_server
from tests.integration.test_fleet import StreamResult, _added, _ledger, chat, stream
from tests.integration.test_ray_placement import cluster  # noqa: F401 (the fixture)

# Shorter: tests/integration/test_ray_placement.py scales 1-2-1 and loses a host.
pytestmark = [pytest.mark.slow, pytest.mark.long]
INTERVAL_S = 0.5
UPSTREAM = "elsewhere"  # a deployment not placed by Ray


def fleet_toml(address: str, name: str, replicas: int, max_replicas: int) -> str:
    return f"""
[balancer]
policy = "round_robin"
discovery_interval_s = {INTERVAL_S}
health_interval_s = 0.5
eject_after = 2
eject_base_s = 1.0

[[deployments]]
name = "{name}"
placement = "ray"
ray_address = "{address}"
replicas = {replicas}
min_replicas = 1
max_replicas = {max_replicas}
engine_args = ["--threads", "1"]
resources = {{ num_cpus = 0, custom = {{ replica_slot = 1 }} }}

[[deployments]]
name = "{UPSTREAM}"
kind = "upstream"
urls = ["http://127.0.0.1:9/v1"]
model = "none"
"""


@contextlib.contextmanager
def ray_gateway(ray_cluster: Any, directory: Path, name: str, replicas: int,
                max_replicas: int) -> Iterator[tuple[Server, Path]]:
    """The gateway over deployment `name` (its replicas placed by it), and its state
    directory; the replica actors are killed afterwards (they outlive the gateway)."""
    import ray

    made, _ = ray_cluster
    config = directory / "tokenyard.toml"
    config.write_text(fleet_toml(made.address, name, replicas, max_replicas))
    state = directory / "state"
    state.mkdir()
    try:
        with running_server("--config", str(config), state_dir=str(state)) as (server, _):
            yield server, state
    finally:
        for i in range(max_replicas):
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(f"{name}/{i}", namespace="tokenyard"),
                         no_restart=True)


async def admin(session: aiohttp.ClientSession, server: Server, method: str, path: str,
                body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    async with session.request(method, f"{server.base_url}/admin/v1{path}", json=body,
                               headers=server.headers) as resp:
        return resp.status, await resp.json()


async def pool_view(session: aiohttp.ClientSession, server: Server,
                    name: str) -> dict[str, dict[str, Any]]:
    """The gateway pool's state of each replica of `name`, by URL."""
    status, body = await admin(session, server, "GET", "/deployments")
    assert status == 200, body
    dep = next(d for d in body["data"] if d["name"] == name)
    return {r["id"]: r for r in dep["replicas"]}


async def until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.2)


def test_admin_route_scales_one_two_one_under_load_without_a_failed_request(
        cluster: Any, tmp_path: Path) -> None:  # noqa: F811
    name = "scaled-http"
    path = f"/deployments/{name}/replicas"

    async def scenario(server: Server) -> list[int]:
        statuses: list[int] = []
        stop = asyncio.Event()
        async with aiohttp.ClientSession() as session:
            # Refusals first, in the admin API's error shape, before anything reaches Ray.
            for where, body, status, param in [
                    (path, {"replicas": 3}, 400, "replicas"),
                    (path, {"replicas": "2"}, 400, "replicas"),
                    ("/deployments/nowhere/replicas", {"replicas": 1}, 404, None),
                    (f"/deployments/{UPSTREAM}/replicas", {"replicas": 1}, 409, None)]:
                got, answer = await admin(session, server, "POST", where, body)
                assert (got, answer["error"]["param"]) == (status, param), answer
            got, listed = await admin(session, server, "GET", path)
            assert got == 200 and [r["name"] for r in listed["data"]] == [f"{name}/0"]
            assert (listed["min_replicas"], listed["max_replicas"]) == (1, 2)

            async def load(worker: int) -> None:
                i = 0
                while not stop.is_set():
                    status, body = await chat(session, server, [
                        {"role": "user", "content": f"Count to {worker}{i}."}], model=name)
                    statuses.append(status)
                    assert status == 200, body
                    i += 1

            workers = [asyncio.create_task(load(w)) for w in range(3)]
            try:
                got, grown = await admin(session, server, "POST", path, {"replicas": 2})
                assert got == 200, grown
                assert [r["name"] for r in grown["data"]] == [f"{name}/0", f"{name}/1"]
                urls = {r["url"] for r in grown["data"]}

                async def both_serve() -> bool:
                    view = await pool_view(session, server, name)
                    return set(view) == urls and all(r["served"] for r in view.values())

                await until(both_serve, 20, "the second replica joins and serves")
                # The listing joins Ray's registry with this gateway's balancer rows.
                got, listed = await admin(session, server, "GET", path)
                assert got == 200 and {r["url"] for r in listed["data"]} == urls
                assert all(r["balancer"] is not None and r["balancer"]["id"] == r["url"]
                           and r["balancer"]["served"] > 0 for r in listed["data"]), listed
                got, shrunk = await admin(session, server, "POST", path, {"replicas": 1})
                assert got == 200, shrunk
                assert [r["name"] for r in shrunk["data"]] == [f"{name}/0"]

                async def one_left() -> bool:
                    return len(await pool_view(session, server, name)) == 1

                await until(one_left, 10, "the drained replica leaves the pool")
                await asyncio.sleep(1.0)  # requests go on after it left
            finally:
                stop.set()
                await asyncio.gather(*workers)
        return statuses

    with ray_gateway(cluster, tmp_path, name, 1, 2) as (server, _):
        statuses = asyncio.run(scenario(server))
    assert statuses and set(statuses) == {200}, statuses


def test_a_node_dies_under_the_gateway_and_ray_repairs_it(
        cluster: Any, tmp_path: Path) -> None:  # noqa: F811
    import ray

    made, hosts = cluster
    name = "spread-http"

    async def scenario(server: Server) -> list[StreamResult]:
        actors = [ray.get_actor(f"{name}/{i}", namespace="tokenyard") for i in range(2)]
        placed = ray.get([a.describe.remote() for a in actors])
        assert {p["node_id"] for p in placed} == {h.node_id for h in hosts}  # one per host
        victim = next(h for h in hosts if h.node_id == placed[1]["node_id"])
        dead_url = placed[1]["url"]
        async with aiohttp.ClientSession() as session:
            await until(lambda: _all_healthy(session, server, name, 2), 20, "both admitted")
            texts = [f"Write a long story about the number {i}." for i in range(4)]
            old = [StreamResult() for _ in texts]
            running = [asyncio.create_task(stream(session, server, t, model=name,
                                                  max_tokens=256, out=r))
                       for t, r in zip(texts, old, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(r.started.wait() for r in old)), 30)
            on_victim = (await pool_view(session, server, name))[dead_url]["inflight"]
            assert on_victim > 0  # round robin: streams run on both replicas
            made.remove_node(victim)  # the host dies, with the actor and its replica
            # Requests without a first byte: all succeed, on the other replica.
            fresh = [asyncio.create_task(stream(session, server, f"Say {i}.", model=name,
                                                max_tokens=8)) for i in range(6)]
            new = await asyncio.wait_for(asyncio.gather(*fresh), 30)
            assert all((r.status, r.error, r.finish_reason) == (200, None, "length")
                       for r in new), new
            # Ray restarts the actor on the surviving host (while the streams there run
            # on); the pool admits its new URL.

            async def restarted() -> bool:
                _, listed = await admin(session, server, "GET", f"/deployments/{name}/replicas")
                urls = {r["name"]: r["url"] for r in listed["data"]}
                return urls.get(f"{name}/1", dead_url) != dead_url and await _all_healthy(
                    session, server, name, 2)

            await until(restarted, 45, "the actor restarts and its replica is admitted")
            broken = await asyncio.wait_for(asyncio.gather(*running), 45)
            assert sum(r.error is not None for r in broken) == on_victim, broken
            for r in broken:  # the others ran to their end
                assert r.error is not None or r.finish_reason == "length", r
            again = ray.get(actors[1].describe.remote())
            assert again["node_id"] == placed[0]["node_id"]
            before = await pool_view(session, server, name)
            after_restart = [await stream(session, server, f"Again {i}.", model=name,
                                          max_tokens=4) for i in range(4)]
            assert all(r.error is None for r in after_restart)
            view = await pool_view(session, server, name)
            assert all(view[u]["served"] > before[u]["served"] for u in view), view
        return [*broken, *new, *after_restart]

    try:
        with ray_gateway(cluster, tmp_path, name, 2, 2) as (server, state):
            before = _ledger(state)
            results = asyncio.run(scenario(server))
            # One ledger row per request, each with its tokens (a failover attempt that
            # produced none writes none); the broken streams' rows are 'failed'.
            assert all(r.content_chunks for r in results)
            completed = sum(r.error is None for r in results)
            expected = {"completed": completed, "failed": len(results) - completed}
            deadline = time.monotonic() + 20
            while (added := _added(before, _ledger(state))) != expected:
                assert time.monotonic() < deadline, (added, expected)
                time.sleep(0.2)
    finally:  # a new host takes the dead one's place, for any test after
        hosts[:] = [h for h in hosts if h in made.worker_nodes]
        hosts.append(made.add_node(num_cpus=1, resources={"replica_slot": 4}))
        made.wait_for_nodes()


async def _all_healthy(session: aiohttp.ClientSession, server: Server, name: str,
                       count: int) -> bool:
    view = await pool_view(session, server, name)
    return len(view) == count and all(r["state"] == "healthy" for r in view.values())
