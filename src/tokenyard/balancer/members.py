"""One replica of a pool as the balancer tracks it (`Member`), and a request's hold on it
(`Lease`): what it is (its id, its client, of the kinds in `balancer/member_clients.py`),
its state (healthy, draining, ejected: kept by `balancer/health.py`), its load and its
counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenyard.balancer.member_clients import MemberClient
from tokenyard.wire.outputs import EngineStats


@dataclass(eq=False)
class Member:
    """One replica of the pool and what the balancer knows of it."""

    id: str
    client: MemberClient
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
    """What a lease returns its capacity to (`failover.Failover`)."""

    def wake(self) -> None:
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
                self.pool.wake()
