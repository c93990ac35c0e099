"""Stage 12's selection: how a pool ranks its replicas for one request (`Policy`).

A pool asks its policy only when two or more members may take work now (healthy, not
draining, not ejected: the pool filters them); the policy returns them best first and
the pool tries them in that order, failing over down the list. A policy learns from what
happened through `placed`: a member accepted a request (the pool has its first byte), so
it now holds that prompt's prefix; and, for a policy that sets `follows_output`, again
when a generation finished, with the prompt followed by the output (a conversation's
next turn starts so).

The fleet file's `balancer.policy` names one entry of `POLICIES`, looked up once when the
pool is built:

- `affinity`: the replica that most recently served the longest prefix of the prompt
  (its block hashes, `balancer/affinity.py`) wins unless its outstanding work exceeds the
  least loaded one's by more than the prefill the prefix saves (at least
  `AFFINITY_SLACK_TOKENS` when it holds most of the prompt); otherwise as `least`.
- `least`: the replica with the fewest tokens in flight from this gateway, then the
  fewest running and waiting requests in its own stats.
- `round_robin`: each member in turn, whatever it holds or carries; the control.
- `precise`: like `affinity`, but by the blocks each replica reports it holds (its KV
  events) rather than by where this gateway sent what (`PrecisePrefix`).

Another policy is one `register_policy` call: the pool and the fleet file's check
(`deployments.POLICIES`, which this registry keeps in step) take it from then on.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenyard import deployments
from tokenyard.balancer.affinity import MAX_BLOCKS, AffinityTable, prefix_hashes
from tokenyard.balancer.kv_index import KVIndex, KVWatcher
from tokenyard.balancer.members import Member
from tokenyard.wire.block_hash import block_key, hash_prompt_blocks

#: Outstanding tokens the replica holding most of a prompt may carry beyond the least
#: loaded one's and still get it (otherwise the allowance is the prefill it saves).
AFFINITY_SLACK_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What a policy knows of the request it places."""

    #: The prompt's block hashes (salted by tenant); empty where the request carries no
    #: token ids (an upstream's chat, an embeddings call) or the prompt is under a block.
    hashes: Sequence[int] = ()
    #: Tokens it holds on its member while it runs (prompt + max_tokens for a generation).
    cost: int = 1
    #: Its priority class (lower first).
    priority: int = 0
    #: The LoRA adapter it runs with (None: the base model).
    lora: str | None = None


class Policy(Protocol):
    """How one pool ranks its members (see the module's docstring).

    `order` and `placed` are each policy's own; the rest have defaults here that a policy
    subclassing `Policy` inherits (the built-in ones do) and overrides where it has more
    to say: `prompt_hashes`, `watch`, `describe`, `close`, `hits`."""

    #: Whether `placed` also hears of a finished generation's prompt + output (the pool
    #: then collects the output tokens of every generation, which costs a little).
    follows_output: bool
    #: Decisions the policy's prefix knowledge changed (the admin view's figure).
    hits: int = 0

    async def order(self, members: list[Member], facts: RequestFacts) -> list[Member]:
        """`members` (two or more, all available) best first for this request."""
        ...

    async def placed(self, hashes: Sequence[int], member: Member) -> None:
        """`member` now holds every prefix in `hashes` (possibly none: an output shorter
        than a block added to a prompt shorter than one)."""
        ...

    def prompt_hashes(self, tokens: Sequence[int], block_size: int,
                      salt: str | None = None) -> list[int]:
        """The prompt's block hashes, computed once per request at prepare: by default the
        approximate table's (`balancer/affinity.prefix_hashes`)."""
        return prefix_hashes(tokens, block_size, salt)

    def watch(self, members: Sequence[Member]) -> None:
        """Begin following what `members` report (in a running loop; idempotent). By
        default nothing: the policy learns from `placed` alone."""
        return None

    def describe(self, member_id: str) -> dict[str, object]:
        """What the policy adds to the member's row of the admin view (default nothing)."""
        return {}

    async def close(self) -> None:
        """Stop what `watch` started (default nothing)."""
        return None


#: What `POLICIES` holds: builds a pool's policy from the pool's prefix table (shared
#: with other pools, and with other gateways when it lives in Redis) and block size.
PolicyFactory = Callable[[AffinityTable, int], Policy]


class LeastOutstanding(Policy):
    """`least`: the lightest load first (`Member.load`).

    It records placements in the prefix table although it does not route by it: a pool
    reloaded with `affinity`, or another gateway sharing the table, finds it current."""

    follows_output = False

    def __init__(self, affinity: AffinityTable, block_size: int) -> None:
        self.affinity = affinity
        self.block_size = block_size

    async def order(self, members: list[Member], facts: RequestFacts) -> list[Member]:
        return sorted(members, key=Member.load)

    async def placed(self, hashes: Sequence[int], member: Member) -> None:
        await self.affinity.record(hashes, member.id)


class RoundRobin(LeastOutstanding):
    """`round_robin`: the members in turn, starting one further each decision."""

    def __init__(self, affinity: AffinityTable, block_size: int) -> None:
        super().__init__(affinity, block_size)
        self._turn = itertools.count()

    async def order(self, members: list[Member], facts: RequestFacts) -> list[Member]:
        start = next(self._turn) % len(members)
        return members[start:] + members[:start]


class PrefixAffinity(LeastOutstanding):
    """`affinity`: the holder of the longest cached prefix first, within a load allowance;
    `hits` counts the decisions it changed."""

    follows_output = True

    def __init__(self, affinity: AffinityTable, block_size: int) -> None:
        super().__init__(affinity, block_size)
        self.hits = 0

    async def order(self, members: list[Member], facts: RequestFacts) -> list[Member]:
        ranked = await super().order(members, facts)
        hashes = facts.hashes
        if not hashes:
            return ranked
        depth = await self.affinity.lookup(hashes)
        if not depth:
            return ranked
        best = max(ranked, key=lambda m: depth.get(m.id, 0))
        least = ranked[0].inflight_tokens
        # The held prefix saves its prefill: worth at most that much extra work queued on
        # its holder (a shared system prompt alone saves little, so it cannot pull every
        # request to one replica).
        held = depth.get(best.id, 0)
        allowance = held * self.block_size
        if 2 * held >= len(hashes):  # most of the prompt: a conversation, keep it
            allowance = max(allowance, AFFINITY_SLACK_TOKENS)
        if held and best.inflight_tokens - least <= allowance:
            self.hits += 1
            ranked.remove(best)
            ranked.insert(0, best)
        return ranked


class PrecisePrefix(LeastOutstanding):
    """`precise`: by the blocks each replica really holds, from its KV events
    (`balancer/kv_index.py`): the member with the least work left once the prefill its
    cached prefix saves is taken off (outstanding tokens − held prefix tokens) first.
    Members without events (upstreams, older replicas) count the approximate table's
    depth instead. The prompt's hashes are the engine's own (`prompt_hashes`)."""

    follows_output = False

    def __init__(self, affinity: AffinityTable, block_size: int,
                 index: KVIndex | None = None) -> None:
        super().__init__(affinity, block_size)
        self.index = index or KVIndex()
        self.hits = 0
        self._watchers: dict[str, KVWatcher] = {}

    def prompt_hashes(self, tokens: Sequence[int], block_size: int,
                      salt: str | None = None) -> list[int]:
        """The prompt's block keys, as the engine hashes its blocks."""
        return [block_key(h) for h in hash_prompt_blocks(tokens, block_size, salt, MAX_BLOCKS)]

    def watch(self, members: Sequence[Member]) -> None:
        """Subscribe to each replica member's events (idempotent; in a running loop)."""
        for m in members:
            if m.id not in self._watchers and hasattr(m.client, "info"):
                self._watchers[m.id] = KVWatcher(self.index, m.id, m.client)
                self._watchers[m.id].start()

    def describe(self, member_id: str) -> dict[str, object]:
        """The member's row in the admin view: whether its events are current, and how
        many of its blocks the index holds."""
        return {"kv_events": member_id in self.index.synced,
                "kv_index_blocks": self.index.blocks_of(member_id)}

    async def close(self) -> None:
        for watcher in self._watchers.values():
            await watcher.close()
        self._watchers.clear()

    async def order(self, members: list[Member], facts: RequestFacts) -> list[Member]:
        self.watch(members)
        ranked = await super().order(members, facts)
        if not facts.hashes:
            return ranked
        depth = self.index.lookup(facts.hashes)
        if any(m.id not in self.index.synced for m in members):
            approx = await self.affinity.lookup(facts.hashes)
            depth.update({m.id: approx.get(m.id, 0) for m in members
                          if m.id not in self.index.synced})
        if not any(depth.values()):
            return ranked
        bs = self.block_size
        best = min(ranked, key=lambda m: m.inflight_tokens - depth.get(m.id, 0) * bs)
        if best is not ranked[0] or depth.get(best.id, 0):
            self.hits += 1
        ranked.remove(best)
        ranked.insert(0, best)
        return ranked


#: Policy name (the fleet file's `balancer.policy`) -> its factory.
POLICIES: dict[str, PolicyFactory] = {}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make `name` a balancer policy: pools built with it from now on use `factory`, and
    the fleet file accepts it."""
    POLICIES[name] = factory
    deployments.POLICIES.add(name)


def make_policy(name: str, affinity: AffinityTable, block_size: int) -> Policy:
    """The policy `name` for one pool; ValueError naming the known ones if it is none."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(
            f"unknown balancer policy {name!r}; one of {', '.join(sorted(POLICIES))}")
    return factory(affinity, block_size)


register_policy("affinity", PrefixAffinity)
register_policy("least", LeastOutstanding)
register_policy("round_robin", RoundRobin)
register_policy("precise", PrecisePrefix)
