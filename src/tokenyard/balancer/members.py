"""One replica of a pool as the balancer tracks it (`Member`), with its bookkeeping.

- **Health**: the pool polls every replica's health route (`probe`); a replica that fails
  it takes no new work until it passes again.
- **Outlier ejection** is passive (`record_failure`): `eject_after` consecutive failures
  (connection errors, 5xx, broken streams) eject a replica for `eject_base_s`, doubled
  for each ejection in a row (capped at a minute; a success ends the row, and failures
  reported while it is ejected do not extend it); it comes back when the time is up and
  its health check passes. A connection refused before the first byte marks the replica
  down at once: the process is gone.
- **Load**: a request holds a `Lease` on its member until it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenyard.balancer.replica_client import ReplicaConnectionError, ReplicaError
from tokenyard.deployments import BalancerSpec
from tokenyard.wire.outputs import EngineStats

logger = logging.getLogger("tokenyard.balancer")

MAX_EJECTION_S = 60.0
#: Health probes in a row without any answer (a round is the interval plus the probe's
#: timeout: 2 s by default) after which a replica's open connections are closed, so its
#: requests fail over or end instead of waiting out a partition.
SILENT_PROBES_TO_CUT = 3
#: A probe without an answer is a busy replica as often as a sick one (its HTTP loop waits
#: behind a long step on a loaded host); one that refuses or says it drains is out at
#: once, one silent for this many probes in a row is out too.
SILENT_PROBES_TO_UNHEALTHY = 2


@dataclass(eq=False)
class Member:
    """One replica of the pool and what the balancer knows of it."""

    id: str
    client: Any
    healthy: bool = True
    draining: bool = False
    ejected_until: float = 0.0
    ejections: int = 0
    failures: int = 0
    inflight: int = 0
    inflight_tokens: int = 0
    served: int = 0
    failed: int = 0
    stats: EngineStats | None = None
    #: Health probes in a row that got no answer at all (timed out).
    silent: int = 0

    def available(self, now: float) -> bool:
        return self.healthy and not self.draining and now >= self.ejected_until

    def load(self) -> tuple[int, int]:
        remote = self.stats.num_running + self.stats.num_waiting if self.stats else 0
        return self.inflight_tokens, remote

    def state(self, now: float) -> str:
        if self.draining:
            return "draining"
        if now < self.ejected_until:
            return "ejected"
        return "healthy" if self.healthy else "unhealthy"

    def snapshot(self, now: float) -> dict[str, Any]:
        """The member's row of `Pool.snapshot`."""
        return {
            "id": self.id, "state": self.state(now), "inflight": self.inflight,
            "inflight_tokens": self.inflight_tokens, "served": self.served, "failed": self.failed,
            "ejections": self.ejections,
            "ejected_for_s": round(max(0.0, self.ejected_until - now), 3),
            "running": self.stats.num_running if self.stats else None,
            "waiting": self.stats.num_waiting if self.stats else None,
            "kv_cache_usage": self.stats.kv_cache_usage if self.stats else None,
            **_cache_figures(self.stats),
        }


def _cache_figures(stats: EngineStats | None) -> dict[str, Any]:
    """A replica's KV blocks in use (of its pool) and its prefix hit rate since it started
    (hit tokens over looked-up tokens; None before any lookup)."""
    if stats is None:
        return {"kv_blocks_used": None, "kv_blocks": None, "prefix_hit_rate": None}
    queries = stats.prefix_cache_queries
    return {
        "kv_blocks_used": stats.num_kv_blocks - stats.num_free_kv_blocks,
        "kv_blocks": stats.num_kv_blocks,
        "prefix_hit_rate": round(stats.prefix_cache_hits / queries, 4) if queries else None,
    }


class Waking(Protocol):
    """What a lease returns its capacity to (`pool.Pool`)."""

    def _wake(self) -> None:
        ...


@dataclass(eq=False)
class Lease:
    """A request's hold on a member until it ends."""

    pool: Waking
    member: Member
    cost: int
    released: bool = field(default=False)

    def release(self, wake: bool = True) -> None:
        """`wake`: capacity was freed (a request ended), so a waiter may try again; a
        failed attempt frees none (waking then makes two waiters ping-pong)."""
        if not self.released:
            self.released = True
            self.member.inflight -= 1
            self.member.inflight_tokens -= self.cost
            if wake:
                self.pool._wake()


async def probe(
    member: Member, spec: BalancerSpec, with_stats: bool,
) -> tuple[bool, EngineStats | None]:
    """One health check of `member` (and its stats if `with_stats`: an engine replica);
    counts the probes in a row that got no answer at all."""
    timeout = max(0.5, spec.health_interval_s)
    try:
        async with asyncio.timeout(timeout):
            ok = bool(await member.client.health())
            stats = None
            stats_fn = getattr(member.client, "stats", None)
            if ok and stats_fn is not None and with_stats:
                with contextlib.suppress(ReplicaError):
                    stats = await stats_fn()
            member.silent = 0
            return ok, stats
    except TimeoutError:
        member.silent += 1
        return False, None
    except (ReplicaError, OSError):
        return False, None


def record_success(member: Member) -> None:
    """A request reached `member`: its run of failures ends, and so does its run of
    ejections (the next one starts from `eject_base_s` again)."""
    member.failures = 0
    member.ejections = 0
    member.served += 1


def record_failure(
    member: Member, exc: Exception, spec: BalancerSpec, pool: str, *,
    before_first_byte: bool,
) -> None:
    """A request failed on `member` (of the pool named `pool`): marks it down when
    nothing listens, ejects it after `spec.eject_after` failures in a row."""
    member.failed += 1
    member.failures += 1
    if before_first_byte and isinstance(exc, ReplicaConnectionError) and (
            "Connect" in str(exc) or "refused" in str(exc).lower()):
        member.healthy = False  # nothing listens: the process is gone
    now = time.monotonic()
    if now < member.ejected_until:
        # Requests that were already on it when it failed report in after the ejection:
        # one incident, so it must not double the ejection once per batch of them (a
        # killed replica's 16 broken streams took it to the 60 s cap at once).
        member.failures = 0
        return
    if member.failures >= spec.eject_after:
        span = min(MAX_EJECTION_S, spec.eject_base_s * 2 ** member.ejections)
        member.ejected_until = now + span
        member.ejections += 1
        member.failures = 0
        logger.warning("replica %s of %s ejected for %.1f s after %r", member.id,
                       pool, span, exc, extra={
                           "event": "replica_ejected", "replica": member.id, "deployment": pool,
                           "ejected_for_s": span, "error": repr(exc)})
