"""Which tokens of which requests go into the next step.

Continuous batching: every step, running requests' decodes are served first (a prompt
never stalls the streams), then prompt tokens go by (priority, arrival), lower priority
numbers first as in vLLM, whether the request already runs (its next chunk) or still waits
(its first): a live request that arrives while batch lines are prefilling gets its prompt
in ahead of their remaining chunks. A long prompt is prefilled in budget-sized chunks.
While more than one request is in the scheduler, a step's prompt tokens are capped at
`prefill_chunk`: a burst of new prompts then costs each decode a bounded wait per step
(not one step as long as the whole budget), and the prompts get their first tokens one after
another instead of all at the end of one long step. A request alone keeps the whole budget,
so a single long prompt is not cut into more steps than it needs.

Preemption frees a request's blocks and recomputes it later (its freed blocks keep their
hashes, so the recompute is often a prefix-cache hit; a constrained request drops its
grammar matcher and replays it from its output tokens). It happens two ways, and a request
never preempts one of a higher class (a smaller priority number):
- the pool runs out under a running request: the lowest-priority, latest running request
  gives way (one already given tokens this step only if its class is lower than the
  requester's; possibly the requester itself), and then only a waiting request that
  outranks a running one is admitted in that step;
- a waiting request cannot start (the `max_num_seqs` seats are taken, or the pool is
  short) while running requests of a lower class hold what it needs: the lowest-priority,
  latest of them are preempted, one at a time, and only if the pool can hold it once they
  are all gone. Since only a strictly lower class is preempted this way, a preempted
  request can never preempt back the one that displaced it, and it is not admitted again
  in the step that preempted it.

A constrained request whose grammar is still compiling stays in the waiting queue, passed
over by those behind it, so a compile never stalls a step. Pinned prefix blocks give way
only to a request that could not run at all otherwise: one alone in the running batch, or
at the head of the queue while nothing runs.

A request's computed count advances when it is scheduled, as in vLLM: a step that completes
a request's tokens leaves one token pending until `update` appends it. That lets the next
step be planned while this one runs (async scheduling, engine/core.py): the pending token is
the next step's input, and a request whose pending token is its last by length is skipped.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenyard.engine.kv_cache import KVBlock, KVCacheManager
from tokenyard.engine.request import Request, RequestStatus
from tokenyard.engine.spec.speculator import Speculator
from tokenyard.engine.step_plan import SchedulerOutput, StepPlan, room_after_preempting

if TYPE_CHECKING:
    from tokenyard.engine.lora.manager import LoraManager

__all__ = ["QueueFullError", "Scheduler", "SchedulerOutput"]


class QueueFullError(RuntimeError):
    """The waiting queue is over its bound; the caller should shed the request."""


@dataclass
class Scheduler:
    kv: KVCacheManager
    max_num_batched_tokens: int = 1024
    #: Prompt tokens in one step while other requests are in flight (None: the budget).
    prefill_chunk: int | None = None
    max_num_seqs: int = 128
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1_000_000
    #: n-gram speculation (None: off): decoding requests draft tokens verified in one step.
    speculator: Speculator | None = None
    #: LoRA slots (None: no adapters): a request starts holding its adapter's slot, and
    #: one whose adapter finds none free waits, passed over by those behind it.
    loras: LoraManager | None = None

    running: list[Request] = field(default_factory=list)  # by sort_key, kept so
    requests: dict[str, Request] = field(default_factory=dict)
    num_preemptions: int = 0
    num_computed_tokens_total: int = 0  # tokens run through the model, all requests
    _waiting: list[tuple[int, float, int, Request]] = field(default_factory=list)
    _tiebreak: itertools.count = field(default_factory=itertools.count)
    _num_waiting: int = 0
    _waiting_tokens: int = 0
    _freed: list[str] = field(default_factory=list)  # for the next SchedulerOutput

    # -- queue -----------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def can_admit(self, num_tokens: int) -> bool:
        return (
            self._num_waiting < self.max_waiting_requests
            and self._waiting_tokens + num_tokens <= self.max_waiting_tokens
        )

    def add_request(self, request: Request) -> None:
        """Queue a new request; raises QueueFullError past the waiting bounds."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not self.can_admit(request.num_tokens):
            raise QueueFullError(
                f"waiting queue full ({self._num_waiting} requests, "
                f"{self._waiting_tokens} tokens)"
            )
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request as aborted and free its blocks; None if unknown or done."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(
            self._waiting,
            (request.priority, request.arrival_time, next(self._tiebreak), request),
        )
        self._num_waiting += 1
        self._waiting_tokens += request.num_tokens

    def _pop_waiting(self) -> Request:
        request = heapq.heappop(self._waiting)[3]
        self._num_waiting -= 1
        self._waiting_tokens -= request.num_tokens
        return request

    def _peek_waiting(self) -> Request | None:
        while self._waiting:
            request = self._waiting[0][3]
            if not request.is_finished:
                return request
            heapq.heappop(self._waiting)  # aborted while waiting: counted out in _finish
        return None

    # -- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = self._plan()
        out.freed, self._freed = self._freed, []
        for request, n in out.scheduled:
            out.starts[request.request_id] = request.num_computed_tokens
            request.num_computed_tokens += n
            if request.num_computed_tokens < request.num_tokens_with_pending:
                continue
            if request.params.max_tokens == 0:
                out.scored.add(request.request_id)
            else:
                request.num_pending += 1
                out.sampling.add(request.request_id)
        return out

    def _plan(self) -> SchedulerOutput:
        plan = StepPlan(SchedulerOutput(), self.max_num_batched_tokens, self._prefill_budget())
        # Decodes first, by priority then arrival (the order `running` is kept in): a
        # prompt never stalls the streams.
        chunks: list[Request] = []  # running requests with prompt tokens left
        if self.speculator is not None:  # drafts for every decode at once (a draft model)
            self.speculator.prepare([r for r in self.running if _left(r) == 1])
        for request in tuple(self.running):  # a copy: preemption removes from it
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            left = _left(request)
            if left > 1:
                chunks.append(request)
            elif left == 1 and plan.budget > 0:
                drafts = (self.speculator.propose(request, plan.budget - 1)
                          if self.speculator is not None else [])
                self._serve(request, 1 + len(drafts), plan, prompt=False)
                if drafts and plan.is_scheduled(request):
                    plan.out.drafts[request.request_id] = drafts
        self._prompts(chunks, plan)
        return plan.out

    def _prompts(self, chunks: list[Request], plan: StepPlan) -> None:
        """Prompt tokens by (priority, arrival), whether the request already runs (its
        next chunk) or waits (its first): a waiting live request's prompt goes ahead of
        the running batch lines' remaining chunks."""
        deferred: list[Request] = []  # grammars still compiling: back in the queue after
        admitting = True
        i = 0
        while plan.room > 0:
            head = self._peek_waiting() if admitting else None
            if i < len(chunks) and (head is None or chunks[i].sort_key <= head.sort_key):
                request = chunks[i]
                i += 1
                if request.status is RequestStatus.RUNNING:  # not preempted this step
                    left = request.num_tokens_with_pending - request.num_computed_tokens
                    self._serve(request, min(left, plan.room), plan, prompt=True)
            elif head is None:
                break
            elif ((head.guided is not None and not head.guided.ready)
                  or (self.loras is not None and not self.loras.ready(head))):
                deferred.append(self._pop_waiting())
            else:
                admitting = self._admit(head, plan)
        for request in deferred:
            self._push_waiting(request)

    def _serve(self, request: Request, num_new: int, plan: StepPlan, *, prompt: bool) -> None:
        """Give a running request `num_new` tokens, preempting while the pool is short."""
        # Alone, the request cannot wait for anyone to finish: pins give way.
        while not self.kv.allocate_slots(request, num_new, unpin=len(self.running) == 1):
            plan.exhausted = True
            victim = self._choose_victim(request, plan)
            self._preempt(victim, plan.out)
            plan.take_back(victim)
            if victim is request:
                return
        plan.give(request, num_new, prompt=prompt)

    def _admit(self, request: Request, plan: StepPlan) -> bool:
        """Start the waiting head, preempting running requests of a lower class (a larger
        priority number) when the seats or the pool are full. False: it cannot start
        now, and nothing behind it in the queue is admitted this step."""
        if request.request_id in plan.preempted_ids:
            return False  # preempted in this step: it does not come straight back
        victims = self._outranked_by(request)
        if plan.exhausted and not victims:
            return False
        while not (len(self.running) < self.max_num_seqs and self._start(request, plan)):
            # The pool must hold it once the victims are gone, or none is preempted.
            cached, num_cached, num_new = self._first_chunk(request, plan)
            if not victims or not room_after_preempting(
                    self.kv, victims, cached, num_cached + num_new):
                return False
            victim = victims.pop()
            self._preempt(victim, plan.out)
            plan.take_back(victim)
        return True

    def _start(self, request: Request, plan: StepPlan) -> bool:
        """Move the waiting head into the running batch with its first prompt chunk;
        False (nothing changed) if the pool cannot hold it."""
        cached, num_cached, num_new = self._first_chunk(request, plan)
        request.num_computed_tokens = num_cached
        if self.loras is not None:
            self.loras.acquire(request)
        if not self.kv.allocate_slots(request, num_new, cached, unpin=not self.running):
            request.num_computed_tokens = 0
            if self.loras is not None:
                self.loras.release(request)
            return False
        popped = self._pop_waiting()
        assert popped is request, "the head of the queue is the request started"
        self.kv.record_lookup(request.num_tokens, num_cached)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
            request.scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=_sort_key)
        plan.give(request, num_new, prompt=True)
        return True

    def _first_chunk(self, request: Request,
                     plan: StepPlan) -> tuple[list[KVBlock], int, int]:
        """A waiting request's prefix hits, the tokens they cover, and the tokens its
        first chunk computes after them."""
        cached = [] if request.scores_prompt else self.kv.find_cached_prefix(request)
        num_cached = len(cached) * self.kv.block_size
        return cached, num_cached, min(request.num_tokens - num_cached, plan.room)

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may compute: `prefill_chunk` while more than one request
        is in the scheduler (others decode, or wait to start), else the whole budget."""
        alone = len(self.running) + self._num_waiting <= 1
        if self.prefill_chunk is None or alone:
            return self.max_num_batched_tokens
        return self.prefill_chunk

    def _choose_victim(self, request: Request, plan: StepPlan) -> Request:
        """Whom `request` preempts when the pool is short: the lowest-priority, latest
        running request not yet given tokens this step, or one given tokens whose class
        is lower than `request`'s (it gives them back). Possibly `request` itself."""
        candidates = [
            r for r in self.running
            if r.status is RequestStatus.RUNNING
            and (not plan.is_scheduled(r) or r.priority > request.priority)
        ]
        return max(candidates, key=lambda r: r.sort_key)

    def _outranked_by(self, request: Request) -> list[Request]:
        """Running requests of a lower class than `request`'s, the first to preempt last."""
        return sorted((r for r in self.running
                       if r.status is RequestStatus.RUNNING and r.priority > request.priority),
                      key=lambda r: r.sort_key)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self._free(request)
        request.num_computed_tokens = 0
        request.num_pending = 0  # a token in flight for it is dropped: recomputed later
        if request.guided is not None:
            request.guided.drop_matcher()
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        out.preempted.append(request)
        self._push_waiting(request)

    # -- after the step --------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               accepted: dict[str, list[int]] | None = None) -> list[Request]:
        """Append the sampled tokens of step `out`, finish stopped requests.

        `sampled` may hold ids that did not sample this step (they are ignored);
        `accepted`: per speculating request, the tokens its verified row keeps (its
        `sampled` token first). Returns the requests that got tokens (finished ones
        included; `num_new_tokens` says how many), and those that only scored their
        prompt (max_tokens 0), finished without one.
        """
        now = time.monotonic()
        advanced: list[Request] = []
        self.num_computed_tokens_total += out.num_batched_tokens
        scored, sampling, running = out.scored, out.sampling, RequestStatus.RUNNING
        for request, _ in out.scheduled:
            request_id = request.request_id
            if request_id in scored and request.status is running:
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                advanced.append(request)
                continue
            if request_id not in sampling:
                continue  # a prefill chunk: no token yet
            if request.status is not running:
                continue  # finished (aborted) or preempted since it was scheduled
            request.num_pending -= 1
            drafts = out.drafts.get(request_id)
            tokens = ([sampled[request_id]] if drafts is None or accepted is None
                      else accepted[request_id])
            if request.first_token_time is None:
                request.first_token_time = now
            request.num_new_tokens = 0
            status = None
            for token in tokens:
                request.append_token(token)
                request.num_new_tokens += 1
                status = request.check_stop()
                if status is not None:
                    break
            if drafts is not None:
                self._settle_drafts(request, drafts, len(tokens) - 1)
            if status is not None:
                self._finish(request, status)
            advanced.append(request)
        return advanced

    def _settle_drafts(self, request: Request, drafts: list[int], kept: int) -> None:
        """The rejected drafts' positions were computed for nothing: the request's
        computed count goes back to the tokens it kept (their KV stays valid)."""
        assert self.speculator is not None
        request.num_computed_tokens -= len(drafts) - kept
        self.speculator.settle(request, drafts, kept)

    def finish_with_stop_string(self, request_id: str, stop: str) -> None:
        """The frontend matched a stop string: finish the request as stopped."""
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished:
            request.stop_reason = stop
            self._finish(request, RequestStatus.FINISHED_STOPPED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            # Still in the heap: it is skipped when it reaches the head.
            self._num_waiting -= 1
            self._waiting_tokens -= request.num_tokens
        self._free(request)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        request.status = status
        request.finished_time = time.monotonic()
        del self.requests[request.request_id]

    def _free(self, request: Request) -> None:
        """Give back a request's KV blocks (its draft model's too) and LoRA slot (the
        runner, its batch row)."""
        self.kv.free(request)
        if self.speculator is not None:
            self.speculator.release(request)
        if self.loras is not None:
            self.loras.release(request)
        self._freed.append(request.request_id)


def _left(request: Request) -> int:
    """Tokens a running request has left to compute; 0 when its token in flight is its
    last by length (nothing after it is worth scheduling)."""
    if request.ends_by_length_with_pending:
        return 0
    return request.num_tokens_with_pending - request.num_computed_tokens


def _sort_key(request: Request) -> tuple[int, float]:
    return request.sort_key
