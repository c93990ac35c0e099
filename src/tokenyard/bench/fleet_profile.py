"""`bench fleet`'s miss profile: where each policy's prefix-cache misses come from.

Each request's prompt tokens and the ones the prefix cache served come back in its usage
(`prompt_tokens_details.cached_tokens`); with one request in flight per org, an org's
records are its conversation generator's requests in order (`bench/tenants.py`, seeded),
so each record is known by its conversation and turn. Per policy:

- **first turns**: a conversation's first request can hit only its org's system prompt
  (on a replica that holds it); their share of the prompt tokens and their hit rate;
- **later turns**: a later turn resends the turn before's prompt (the rest, the previous
  reply and a new user message, is new text no cache holds), so the turn before's prompt,
  cut to whole KV blocks, is what it can hit at best: the *reachable* share of its prompt
  tokens; and of those reachable tokens, the share it missed (its prefix was evicted, or
  the request went to a replica that never held it);
- **ceiling**: the hit rate with every later turn's reachable tokens and every first
  turn's system-prompt tokens hit, except each org's first request of a run (fresh
  replicas); an org's system prompt counts as the largest hit any first turn of that org
  got under any policy (its whole system prompt, in blocks, once some replica held it);
- the KV blocks the replicas evicted to make room (their stats, over the run).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from tokenyard.bench.stats import RequestRecord
from tokenyard.bench.workloads import RequestSpec


@dataclass
class MissProfile:
    policy: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    first_tokens: int = 0
    first_cached: int = 0
    #: Per org: its first turns after its first request (fresh replicas: nothing cached
    #: yet), and the largest hit of any of its first turns (its system prompt's blocks).
    first_repeats: dict[int, int] = field(default_factory=dict)
    first_hit_max: dict[int, int] = field(default_factory=dict)
    later_tokens: int = 0
    later_cached: int = 0
    later_reachable: int = 0
    later_reachable_missed: int = 0
    evicted_blocks: int = 0
    #: Per org, summed over its requests: the prompt tokens of its open conversations
    #: after the request, their count less one (the system prompt they repeat), and
    #: the requests (`working_set_tokens`).
    live_tokens: dict[int, int] = field(default_factory=dict)
    live_repeats: dict[int, int] = field(default_factory=dict)
    requests: dict[int, int] = field(default_factory=dict)
    #: Requests without usage (no cached_tokens: an older server, or a failure).
    unknown: int = 0

    def add(self, other: MissProfile) -> None:
        for name in self.__dataclass_fields__:
            if isinstance(getattr(self, name), dict):
                mine, theirs = getattr(self, name), getattr(other, name)
                for org, n in theirs.items():
                    mine[org] = (max(mine.get(org, 0), n) if name == "first_hit_max"
                                 else mine.get(org, 0) + n)
            elif name != "policy":
                setattr(self, name, getattr(self, name) + getattr(other, name))

    def ceiling(self, system_blocks: dict[int, int]) -> float:
        """The hit rate with every reachable token hit; `system_blocks`: each org's
        system prompt in cached tokens (the largest first-turn hit of any policy)."""
        best = self.later_reachable + sum(n * system_blocks.get(org, 0)
                                          for org, n in self.first_repeats.items())
        return best / self.prompt_tokens if self.prompt_tokens else 0.0


def profile_org(policy: str, org: int, specs: Iterator[RequestSpec],
                records: Sequence[RequestRecord], block_size: int, turns: int) -> MissProfile:
    """One org's records (in order) against its generator's requests (`turns` per
    conversation)."""
    out = MissProfile(policy)
    previous: dict[int | None, int] = {}  # conversation → its last turn's prompt tokens
    firsts: list[int] = []
    lives: list[tuple[int, int]] = []  # (open conversations' prompt tokens, their count)
    for spec, record in zip(specs, sorted(records, key=lambda r: r.index), strict=False):
        prompt, cached = record.prompt_tokens, record.cached_tokens
        if not record.ok or prompt is None or cached is None:
            out.unknown += 1
            previous.pop(spec.conversation, None)
            continue
        out.prompt_tokens += prompt
        out.cached_tokens += cached
        if spec.turn == 0 or spec.conversation not in previous:
            out.first_tokens += prompt
            out.first_cached += cached
            firsts.append(cached)
        else:
            reachable = previous[spec.conversation] // block_size * block_size
            out.later_tokens += prompt
            out.later_cached += cached
            out.later_reachable += reachable
            out.later_reachable_missed += max(0, reachable - cached)
        previous[spec.conversation] = prompt
        lives.append((sum(previous.values()), len(previous)))
        if spec.turn + 1 >= turns:
            del previous[spec.conversation]  # ended; a new one takes its place
    out.live_tokens[org] = sum(total for total, _ in lives)
    out.live_repeats[org] = sum(n - 1 for _, n in lives if n)
    out.requests[org] = len(lives)
    # The org's first request meets fresh replicas: its system prompt was nowhere yet.
    out.first_repeats[org] = max(0, len(firsts) - 1)
    out.first_hit_max[org] = max(firsts, default=0)
    return out


def profile(policy: str, orgs: Sequence[tuple[Iterator[RequestSpec], Sequence[RequestRecord]]],
            block_size: int, turns: int, evicted_blocks: int) -> MissProfile:
    """A run's profile: `orgs` pairs each org's requests with its records."""
    total = MissProfile(policy, evicted_blocks=evicted_blocks)
    for org, (specs, records) in enumerate(orgs):
        total.add(profile_org(policy, org, specs, records, block_size, turns))
    return total


def _system_tokens(profiles: Sequence[MissProfile]) -> dict[int, int]:
    """Each org's system prompt in cached tokens: the largest hit of its first turns."""
    system: dict[int, int] = {}
    for p in profiles:
        for org, hit in p.first_hit_max.items():
            system[org] = max(system.get(org, 0), hit)
    return system


def working_set_tokens(profiles: Sequence[MissProfile]) -> float:
    """The orgs' live sets together (each org's open conversations, its system prompt
    once, averaged over its requests in all `profiles`): the tokens the fleet would hold
    to hit everything reachable."""
    total = MissProfile("all")
    for p in profiles:
        total.add(p)
    system = _system_tokens(profiles)
    return sum((total.live_tokens[org] - system.get(org, 0) * total.live_repeats[org]) / n
               for org, n in total.requests.items() if n)


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "–"


def table(profiles: Sequence[MissProfile]) -> str:
    """One row per policy, its rounds summed."""
    by: dict[str, MissProfile] = {}
    for p in profiles:
        by.setdefault(p.policy, MissProfile(p.policy)).add(p)
    system = _system_tokens(profiles)
    lines = ["| policy | hit rate (usage) | ceiling | first turns: share of tokens "
             "| first turns: hit rate | later turns: hit rate | later turns: reachable "
             "| reachable tokens missed | evicted KV blocks |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, p in by.items():
        lines.append(
            f"| {name} | {_pct(p.cached_tokens, p.prompt_tokens)} "
            f"| {100 * p.ceiling(system):.1f} % "
            f"| {_pct(p.first_tokens, p.prompt_tokens)} "
            f"| {_pct(p.first_cached, p.first_tokens)} "
            f"| {_pct(p.later_cached, p.later_tokens)} "
            f"| {_pct(p.later_reachable, p.later_tokens)} "
            f"| {_pct(p.later_reachable_missed, p.later_reachable)} "
            f"| {p.evicted_blocks:,} |")
    unknown = sum(p.unknown for p in by.values())
    if unknown:
        lines += ["", f"{unknown} request(s) without usage left out."]
    return "\n".join(lines)

