"""Engine replicas placed by Ray (`placement = "ray"`, `placement_spec.py`): each replica is
a Ray actor that starts the replica server (`tokenyard engine`) as its child on its node,
on the node's address, with the replica token; the replica dies with its actor (the
kernel's parent-death signal), and Ray restarts a dead actor (`max_restarts`), possibly
on another node, which starts a new replica there. A replica that dies on its own (OOM
killer, crash) ends its actor too, so that Ray restarts both.

- **Registry**: one named, detached actor (`tokenyard-replicas`) holds each live
  replica's URL by actor name; an actor registers once its replica listens (again after
  a restart, with its new URL). Gateways read it every `discovery_interval_s`
  (`balancer/discovery.py`) and their pools follow: a new URL joins, a vanished one
  drains and leaves.
- **Names**: replica *i* of deployment *D* is the actor `D/i` (detached: it outlives the
  gateway that created it), so several gateways that ensure the same replicas create
  each once.
- **Scale down** drains: the replica leaves the registry, the gateways have a discovery
  round to stop sending it work, its running requests end (or `drain_timeout_s`
  passes), and only then is its actor killed.

Ray is imported only here and only when a deployment is placed by it (the `ray` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from tokenyard.cli.processes import READY_MARK, die_with_parent
from tokenyard.config import REPLICA_TOKEN_ENV
from tokenyard.placement_spec import RayPlacement
from tokenyard.wire.protocol import STATS_PATH

NAMESPACE = "tokenyard"
REGISTRY = "tokenyard-replicas"
#: The resource only a Ray cluster's head node has.
HEAD_RESOURCE = "node:__internal_head__"
#: Restarts Ray gives a replica actor that died (-1: without end).
MAX_RESTARTS = -1


class Registry:
    """The live replicas' URLs, by deployment and actor name (a Ray actor)."""

    def __init__(self) -> None:
        self.urls: dict[str, dict[str, str]] = {}

    def register(self, deployment: str, name: str, url: str) -> None:
        self.urls.setdefault(deployment, {})[name] = url

    def unregister(self, deployment: str, name: str) -> None:
        self.urls.get(deployment, {}).pop(name, None)

    def listing(self, deployment: str) -> dict[str, str]:
        return dict(self.urls.get(deployment, {}))


class ReplicaActor:
    """One engine replica: its server runs as this actor's child on this node."""

    def __init__(self, deployment: str, name: str, command: Sequence[str],
                 token: str | None, start_timeout_s: float) -> None:
        import ray

        self.deployment, self.name = deployment, name
        self.host = ray.util.get_node_ip_address()
        env = {**os.environ, **({REPLICA_TOKEN_ENV: token} if token else {})}
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        began = time.monotonic()
        self.proc = subprocess.Popen(
            [*command, "--host", self.host, "--port", "0"], stdout=subprocess.PIPE,
            stderr=None, env=env, preexec_fn=die_with_parent, text=True)
        self.url = self._ready_url(start_timeout_s)
        self.start_s = time.monotonic() - began
        self._stopping = False
        threading.Thread(target=self._watch, daemon=True).start()
        registry = ray.get_actor(REGISTRY, namespace=NAMESPACE)
        ray.get(registry.register.remote(deployment, name, self.url))

    def _ready_url(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        timer = threading.Timer(timeout_s, self.proc.kill)
        timer.start()
        try:
            for line in self.proc.stdout:
                if READY_MARK in line:
                    return line.rsplit(READY_MARK, 1)[1].strip()
                sys.stderr.write(line)
        finally:
            timer.cancel()
        raise RuntimeError(f"replica {self.name} exited with code {self.proc.wait()} "
                           "before it was ready")

    def _watch(self) -> None:
        """Forward the replica's output until it ends. A replica that ended on its own
        (killed by the kernel's OOM killer, crashed) leaves the registry and takes this
        actor with it, so that Ray restarts the actor, which starts a new replica: an
        actor alive beside a dead replica would never be restarted."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            sys.stderr.write(line)
        code = self.proc.wait()
        if self._stopping:
            return
        print(f"tokenyard: replica {self.name} exited with code {code}; its actor exits "
              "for Ray to restart it", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # the registry may be gone with its node
            import ray

            registry = ray.get_actor(REGISTRY, namespace=NAMESPACE)
            ray.get(registry.unregister.remote(self.deployment, self.name), timeout=5)
        os._exit(1)  # an unexpected death: Ray restarts the actor (max_restarts)

    def _busy(self) -> bool:
        """Whether the replica has requests running or waiting (False if it cannot tell)."""
        request = urllib.request.Request(self.url + STATS_PATH, headers=self.auth)
        try:
            with urllib.request.urlopen(request, timeout=2.0) as response:
                stats = json.loads(response.read())
        except (OSError, ValueError):
            return False
        return bool(stats.get("num_running") or stats.get("num_waiting"))

    def describe(self) -> dict[str, Any]:
        """Its URL, node and how long its replica took to listen (s)."""
        import ray

        return {"name": self.name, "url": self.url, "start_s": round(self.start_s, 3),
                "node_id": ray.get_runtime_context().get_node_id(), "pid": self.proc.pid}

    def stop(self, drain_timeout_s: float) -> int:
        """Wait until the replica runs nothing (its stats), at most `drain_timeout_s`; then
        SIGTERM it (it drains what came meanwhile: new requests 503, running ones end) and
        wait, SIGKILL after a little more. Its exit code."""
        deadline = time.monotonic() + drain_timeout_s
        while time.monotonic() < deadline and self._busy():
            time.sleep(0.05)
        self._stopping = True  # its end is asked for: the actor stays (to be killed)
        self.proc.terminate()
        try:
            return self.proc.wait(drain_timeout_s + 5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def connect(placement: RayPlacement) -> None:
    """Join the Ray cluster (idempotent) and make sure the registry exists."""
    import ray

    if not ray.is_initialized():
        address = placement.address or os.environ.get("RAY_ADDRESS") or "auto"
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                 ignore_reinit_error=True)
    # On the head node: the cluster ends with it anyway, while a worker node may go.
    ray.remote(Registry).options(name=REGISTRY, namespace=NAMESPACE, lifetime="detached",
                                 get_if_exists=True, num_cpus=0,
                                 resources={HEAD_RESOURCE: 0.001}).remote()


def actor_name(deployment: str, index: int) -> str:
    return f"{deployment}/{index}"


def existing(deployment: str) -> list[int]:
    """The indexes of the deployment's replica actors alive or restarting now."""
    import ray

    prefix = f"{deployment}/"
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        namespace = entry.get("namespace") if isinstance(entry, dict) else NAMESPACE
        if namespace == NAMESPACE and name.startswith(prefix) and name[len(prefix):].isdigit():
            found.append(int(name[len(prefix):]))
    return sorted(found)


def place(deployment: str, placement: RayPlacement, index: int, command: Sequence[str],
          token: str | None, start_timeout_s: float) -> Any:
    """Replica `index`'s actor (created unless it exists), spread over the nodes."""
    import ray

    return ray.remote(ReplicaActor).options(
        name=actor_name(deployment, index), namespace=NAMESPACE, lifetime="detached",
        get_if_exists=True, max_restarts=MAX_RESTARTS, max_concurrency=4,
        num_cpus=placement.num_cpus, num_gpus=placement.num_gpus,
        resources=dict(placement.custom) or None, scheduling_strategy="SPREAD",
    ).remote(deployment, actor_name(deployment, index), list(command), token,
             start_timeout_s)


async def listing(deployment: str) -> dict[str, str]:
    """The deployment's live replicas: URL by actor name (the registry's)."""
    import ray

    registry = ray.get_actor(REGISTRY, namespace=NAMESPACE)
    found: dict[str, str] = await registry.listing.remote(deployment)
    return found


async def urls(deployment: str) -> list[str]:
    """The deployment's live replica URLs (a discovery `Source`)."""
    return sorted((await listing(deployment)).values())


async def serving(deployment: str, timeout_s: float) -> list[str]:
    """The deployment's replica URLs once it has one (its actors may still be starting
    their replicas: another gateway placed them); RuntimeError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (found := await urls(deployment)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{deployment}: no replica serves after {timeout_s:g} s")
        await asyncio.sleep(0.5)
    return found


async def scale(deployment: str, placement: RayPlacement, count: int,
                command: Sequence[str], token: str | None, *, start_timeout_s: float,
                discovery_interval_s: float, drain_timeout_s: float) -> list[int]:
    """Make the deployment `count` replicas: new ones are created (and awaited until they
    serve); surplus ones, highest index first, drain and go. The indexes now."""
    import ray

    placement.check(count)
    have = existing(deployment)
    new = [place(deployment, placement, i, command, token, start_timeout_s)
           for i in range(count) if i not in have]
    try:
        async with asyncio.timeout(start_timeout_s):
            await asyncio.gather(*(actor.describe.remote() for actor in new))
    except TimeoutError:
        raise RuntimeError(f"{deployment}: {len(new)} new replica(s) did not serve within "
                           f"{start_timeout_s:g} s (does the cluster have the resources "
                           "they ask for?)") from None
    surplus = [i for i in have if i >= count]
    if surplus:
        registry = ray.get_actor(REGISTRY, namespace=NAMESPACE)
        for i in surplus:
            await registry.unregister.remote(deployment, actor_name(deployment, i))
        await asyncio.sleep(discovery_interval_s)  # every gateway has stopped sending
        actors = [ray.get_actor(actor_name(deployment, i), namespace=NAMESPACE)
                  for i in surplus]
        await asyncio.gather(*(a.stop.remote(drain_timeout_s) for a in actors))
        for actor in actors:
            ray.kill(actor, no_restart=True)
    return existing(deployment) if surplus else sorted({*have, *range(count)})


def replica_command(model: str | None, engine_args: Sequence[str],
                    drain_timeout_s: float) -> list[str]:
    """`tokenyard engine` as the actor runs it (it adds --host and --port)."""
    return [sys.executable, "-m", "tokenyard.cli", "engine",
            "--drain-timeout", str(drain_timeout_s),
            *(["--model", model] if model else []), *engine_args]
