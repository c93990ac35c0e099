"""A step being planned: its output, its budgets, and what preempting would free.

`SchedulerOutput` is the step the scheduler hands the runner. While the scheduler plans it
(`StepPlan`), it gives tokens in order and may take them back: a request preempted after
it was given tokens in the same step (a lower class making room for a higher one) gives
its tokens back to the budgets it was charged to. `room_after_preempting` answers whether
preempting a set of running requests would free the KV blocks a newcomer needs, before
any of them is preempted, so a preemption that could not seat it never happens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenyard.engine.kv_cache import KVBlock, KVCacheManager
from tokenyard.engine.request import Request


@dataclass
class SchedulerOutput:
    """The step's work: (request, number of tokens to compute) in batch order."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    #: Per request id: the first position this step computes.
    starts: dict[str, int] = field(default_factory=dict)
    #: The requests whose last computed position gets a sampled token this step.
    sampling: set[str] = field(default_factory=set)
    #: Requests that only score their prompt (max_tokens 0), whose last prompt token is
    #: computed this step: they finish after it with no token.
    scored: set[str] = field(default_factory=set)
    #: Per speculating request id: the drafts its row computes after its last token
    #: (engine/spec/speculator.py); each of its positions is sampled.
    drafts: dict[str, list[int]] = field(default_factory=dict)
    #: Requests whose KV blocks were freed (finished or preempted) since the step before,
    #: this step's preemptions included: the runner gives their batch rows back.
    freed: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepPlan:
    """The step's output so far and the token budgets left (all in tokens)."""

    out: SchedulerOutput
    budget: int  # tokens of any kind
    prefill: int  # prompt tokens (the `prefill_chunk` cap)
    #: A running request was preempted because the pool ran out: only a request that
    #: outranks a running one is admitted after that (the rest would thrash the pool).
    exhausted: bool = False
    #: Per scheduled request id: (tokens given, of them charged to `prefill`).
    _given: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Ids preempted during this step: none of them is admitted again in it.
    preempted_ids: set[str] = field(default_factory=set)

    @property
    def room(self) -> int:
        """Prompt tokens the step may still take."""
        return min(self.budget, self.prefill)

    def is_scheduled(self, request: Request) -> bool:
        return request.request_id in self._given

    def give(self, request: Request, num_tokens: int, *, prompt: bool) -> None:
        """Schedule `num_tokens` of `request`; `prompt`: they count against `prefill`."""
        charged = num_tokens if prompt else 0
        self.out.scheduled.append((request, num_tokens))
        self._given[request.request_id] = (num_tokens, charged)
        self.budget -= num_tokens
        self.prefill -= charged

    def take_back(self, request: Request) -> None:
        """`request` was preempted: drop its tokens from the step (if it had any) and
        return them to the budgets."""
        self.preempted_ids.add(request.request_id)
        given = self._given.pop(request.request_id, None)
        if given is None:
            return
        self.out.scheduled = [(r, n) for r, n in self.out.scheduled if r is not request]
        self.budget += given[0]
        self.prefill += given[1]


def room_after_preempting(kv: KVCacheManager, victims: Sequence[Request],
                          cached: Sequence[KVBlock], num_tokens: int) -> bool:
    """Whether the pool could hold a new request's first `num_tokens` (its prefix hits
    `cached` included) once every request of `victims` is preempted.

    A victim's block is freed only if no one else holds it and it is not pinned; a block
    the newcomer hits is taken back by it, so freeing it gains nothing.
    """
    pool = kv.pool
    need = kv.blocks_needed(num_tokens) - len(cached)
    hit_ids = {block.block_id for block in cached}
    # Hits now in the free queue leave it when the newcomer takes them.
    free = pool.num_free_blocks - sum(
        1 for block in cached if block.ref_cnt == 0 and not pool.is_pinned(block))
    held = Counter(block.block_id
                   for victim in victims for block in kv.block_tables.get(victim.request_id, []))
    freed = sum(
        1 for block_id, count in held.items()
        if pool.blocks[block_id].ref_cnt == count and block_id not in hit_ids
        and not pool.is_pinned(pool.blocks[block_id]))
    return free + freed >= need
