"""`bench fleet`'s decision-time part: the balancer's `balance` stage with the `precise`
policy's index at a size no replica fleet on this machine reaches (the issue's goal: p50
≤ 0.2 ms at 100,000 indexed blocks).

In process, no replicas: a `Pool` of `members` whose index (`balancer/kv_index.py`) is fed
synthetic `BlockStored` events — chains of `chain` blocks, each stored by one member and
some by a second — until it holds `blocks` keys; then `Pool.acquire` decides for prompts
of `prompt_blocks` blocks, and the stage the pool itself times (`Server-Timing`'s
`balance`) is read from the request's timeline. Half the prompts start with an indexed
chain (the lookup walks it to its end), half with nothing indexed (the lookup stops at
the first block); the members carry random outstanding work.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenyard.balancer.members import Member
from tokenyard.balancer.policy import PrecisePrefix
from tokenyard.balancer.pool import Pool
from tokenyard.bench.stats import percentile
from tokenyard.deployments import BalancerSpec
from tokenyard.telemetry.timeline import Timeline
from tokenyard.wire.kv_events import EventBatch


class _NoClient:
    """A member's client that is never called: an upstream's shape (no `info`: the policy
    watches nothing)."""

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        return None

    def open_chat(self, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError

    def open_completion(self, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError


@dataclass
class DecisionResult:
    blocks: int
    members: int
    prompt_blocks: int
    p50_ms: float
    p99_ms: float
    decisions: int


async def _measure(blocks: int, members: int, chain: int, prompt_blocks: int,
                   decisions: int, seed: int) -> DecisionResult:
    rng = random.Random(seed)
    spec = BalancerSpec(policy="precise", health_interval_s=0)
    pool = Pool("bench-decision", [(f"r{i}", _NoClient()) for i in range(members)], spec)
    policy = pool.policy
    assert isinstance(policy, PrecisePrefix)
    index = policy.index
    ids = [m.id for m in pool.members]
    chains: list[list[int]] = []
    while len(index) < blocks:
        keys = [rng.getrandbits(63) for _ in range(min(chain, blocks - len(index)))]
        holders = rng.sample(ids, 2 if rng.random() < 0.25 else 1)
        for member in holders:
            index.apply(member, EventBatch(0.0, [("stored", keys, None, None)]))
        chains.append(keys)
    index.synced.update(ids)

    async def chosen(member: Member) -> Member:
        return member

    samples: list[float] = []
    for i in range(decisions):
        for m in pool.members:
            m.inflight_tokens = rng.randrange(0, 4096)
        head = rng.choice(chains) if i % 2 == 0 else []
        hashes = [*head, *(rng.getrandbits(63) for _ in range(prompt_blocks - len(head)))]
        timeline = Timeline()
        lease, _ = await pool.acquire(chosen, hashes=hashes[:prompt_blocks],
                                      cost=16 * prompt_blocks, timeline=timeline)
        lease.release()
        samples.append(timeline.durations_ns()["balance"] / 1e6)
    await pool.close()
    return DecisionResult(len(index), members, prompt_blocks, percentile(samples, 50),
                          percentile(samples, 99), decisions)


def measure(blocks: int = 100_000, members: int = 4, chain: int = 64,
            prompt_blocks: int = 128, decisions: int = 2000, seed: int = 0) -> DecisionResult:
    """One round: `decisions` decisions over an index of `blocks` keys (see the module's
    docstring)."""
    return asyncio.run(_measure(blocks, members, chain, prompt_blocks, decisions, seed))


def table(rounds: Sequence[DecisionResult], goal_ms: float) -> str:
    """The rounds' p50 and p99 of the `balance` stage: median (min–max)."""
    first = rounds[0]
    p50s = sorted(r.p50_ms for r in rounds)
    p99s = sorted(r.p99_ms for r in rounds)

    def cell(values: list[float]) -> str:
        return (f"{percentile(values, 50):.4f} ({values[0]:.4f}–{values[-1]:.4f})")

    return "\n".join([
        "| indexed blocks | members | prompt blocks | decisions per round | rounds "
        "| `balance` p50 (ms) | `balance` p99 (ms) |",
        "|---|---|---|---|---|---|---|",
        f"| {first.blocks:,} | {first.members} | {first.prompt_blocks} | {first.decisions} "
        f"| {len(rounds)} | {cell(p50s)} | {cell(p99s)} |",
        "",
        f"The `balance` stage's p50 at {first.blocks:,} indexed blocks is "
        f"{percentile(p50s, 50) / goal_ms:.2f}× the goal of {goal_ms:g} ms (median of the "
        "rounds' p50s).",
    ])
