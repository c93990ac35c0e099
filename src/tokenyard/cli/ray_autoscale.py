"""Autoscaling a Ray-placed deployment on the replicas' own figures (its `autoscale` table,
`placement_spec.Autoscale`): every `interval_s` the requests running and queued on each
replica (and the fullest one's KV-cache use) give the replicas wanted, within
min_replicas..max_replicas; a change waits `cooldown_s` after the one before, and a
scale-down drains (`ray_replicas.scale`).

One decider per deployment, whatever the number of gateways: a named detached actor
(`D/autoscaler`) on the head node runs the loop. On a Ray cluster with its own autoscaler,
replica actors that wait for resources make it add nodes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenyard.cli import ray_replicas
from tokenyard.placement_spec import Autoscale, RayPlacement
from tokenyard.wire.protocol import STATS_PATH

#: (requests running plus queued, KV-cache use 0..1) of one replica.
Load = tuple[int, float]


def wanted(current: int, loads: Sequence[Load], rule: Autoscale, low: int, high: int) -> int:
    """The replicas the figures call for: the work over `target_work` per replica, one
    more than now when the fullest KV cache passed `kv_target`; within low..high."""
    need = math.ceil(sum(work for work, _ in loads) / rule.target_work)
    if rule.kv_target is not None and loads and max(kv for _, kv in loads) > rule.kv_target:
        need = max(need, current + 1)
    return min(high, max(low, need))


@dataclass
class Decider:
    """`wanted`, with a cooldown between changes."""

    rule: Autoscale
    low: int
    high: int
    changed_at: float = -math.inf

    def decide(self, now: float, current: int, loads: Sequence[Load]) -> int | None:
        """The new replica count, or None: keep (no figures, no change, or cooling down)."""
        if not loads:
            return None
        target = wanted(current, loads, self.rule, self.low, self.high)
        if target == current or now - self.changed_at < self.rule.cooldown_s:
            return None
        self.changed_at = now
        return target


async def replica_load(session: Any, url: str) -> Load | None:
    """One replica's figures from its stats route (None: it did not answer)."""
    try:
        async with session.get(url + STATS_PATH) as response:
            stats = await response.json()
        return int(stats["num_running"]) + int(stats["num_waiting"]), float(
            stats.get("kv_cache_usage") or 0.0)
    except Exception:  # a replica starting or gone: no figures from it this round
        return None


class AutoscalerActor:
    """The loop of one deployment (a Ray actor: see the module's docstring)."""

    def __init__(self, deployment: str, placement: RayPlacement, command: Sequence[str],
                 token: str | None, timeouts: dict[str, float]) -> None:
        assert placement.autoscale is not None
        self.deployment, self.placement = deployment, placement
        self.command, self.token, self.timeouts = list(command), token, timeouts
        self.decider = Decider(placement.autoscale, placement.min_replicas,
                               placement.max_replicas)
        self.running = False
        self.decisions: list[tuple[int, int]] = []

    async def run(self) -> None:
        """Decide every `interval_s` until the actor ends (a second call returns at once)."""
        import aiohttp

        if self.running:
            return
        self.running = True
        rule = self.decider.rule
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        timeout = aiohttp.ClientTimeout(total=max(1.0, rule.interval_s))
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
            while True:
                await asyncio.sleep(rule.interval_s)
                urls = await ray_replicas.urls(self.deployment)
                found = await asyncio.gather(*(replica_load(session, u) for u in urls))
                current = len(ray_replicas.existing(self.deployment))
                target = self.decider.decide(time.monotonic(), current,
                                             [f for f in found if f is not None])
                if target is not None:
                    self.decisions.append((current, target))
                    await ray_replicas.scale(self.deployment, self.placement, target,
                                             self.command, self.token, **self.timeouts)

    def history(self) -> list[tuple[int, int]]:
        """The changes made so far: (replicas before, after)."""
        return list(self.decisions)


def start(deployment: str, placement: RayPlacement, command: Sequence[str],
          token: str | None, timeouts: dict[str, float]) -> Any:
    """The deployment's autoscaler actor, created unless it exists, and its loop running."""
    import ray

    actor: Any = ray.remote(AutoscalerActor).options(
        name=f"{deployment}/autoscaler", namespace=ray_replicas.NAMESPACE,
        lifetime="detached", get_if_exists=True, num_cpus=0, max_concurrency=8,
        resources={ray_replicas.HEAD_RESOURCE: 0.001},
    ).remote(deployment, placement, list(command), token, timeouts)
    actor.run.remote()
    return actor
