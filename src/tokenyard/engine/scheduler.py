"""Which tokens of which requests go into the next step.

Continuous batching: every step, running requests are served first (decodes ahead of prefill
chunks so a long prompt never stalls the streams), then waiting requests join while the
token budget and the KV pool allow. A long prompt is prefilled in budget-sized chunks. While
more than one request is in the scheduler, a step's prompt tokens are capped at
`prefill_chunk`: a burst of new prompts then costs each decode a bounded wait per step
(not one step as long as the whole budget), and the prompts get their first tokens one after
another instead of all at the end of one long step. A request alone keeps the whole budget,
so a single long prompt is not cut into more steps than it needs. When
the pool runs out, the lowest-priority running request is preempted: its blocks are freed
and it is recomputed later (its freed blocks keep their hashes, so the recompute is often
a prefix-cache hit; a constrained request drops its grammar matcher and replays it from its
output tokens). A constrained request whose grammar is still compiling stays in the waiting
queue, passed over by those behind it, so a compile never stalls a step. Pinned prefix
blocks give way only to a request that could not run at all otherwise: one alone in the
running batch, or at the head of the queue while nothing runs.

A request's computed count advances when it is scheduled, as in vLLM: a step that completes
a request's tokens leaves one token pending until `update` appends it. That lets the next
step be planned while this one runs (async scheduling, engine/core.py): the pending token is
the next step's input, and a request whose pending token is its last by length is skipped.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from tokenyard.engine.kv_cache import KVCacheManager
from tokenyard.engine.request import Request, RequestStatus


class QueueFullError(RuntimeError):
    """The waiting queue is over its bound; the caller should shed the request."""


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

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class Scheduler:
    kv: KVCacheManager
    max_num_batched_tokens: int = 1024
    #: Prompt tokens in one step while other requests are in flight (None: the budget).
    prefill_chunk: int | None = None
    max_num_seqs: int = 128
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1_000_000

    running: list[Request] = field(default_factory=list)
    requests: dict[str, Request] = field(default_factory=dict)
    num_preemptions: int = 0
    num_computed_tokens_total: int = 0  # tokens run through the model, all requests
    _waiting: list[tuple[int, float, int, Request]] = field(default_factory=list)
    _tiebreak: itertools.count = field(default_factory=itertools.count)
    _num_waiting: int = 0
    _waiting_tokens: int = 0

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
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        # Decodes first, then prefill chunks; within each, priority then arrival.
        order = sorted(
            self.running,
            key=lambda r: (r.num_tokens_with_pending - r.num_computed_tokens > 1, r.sort_key),
        )
        prefill = self._prefill_budget()
        for request in order:
            if request.status is not RequestStatus.RUNNING or request.ends_by_length_with_pending:
                continue  # preempted earlier in this loop, or its last token is in flight
            left = request.num_tokens_with_pending - request.num_computed_tokens
            num_new = min(left, budget if left == 1 else min(budget, prefill))
            if num_new <= 0:
                continue
            # Alone, the request cannot wait for anyone to finish: pins give way.
            while not self.kv.allocate_slots(request, num_new, unpin=len(self.running) == 1):
                victim = self._choose_victim(scheduled_ids)
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new
                prefill -= num_new if left > 1 else 0

        if out.preempted:
            return out  # admitting new work now would only thrash the pool

        deferred: list[Request] = []  # grammars still compiling: back in the queue after
        while min(budget, prefill) > 0 and len(self.running) < self.max_num_seqs:
            head = self._peek_waiting()
            if head is None:
                break
            request = head
            if request.guided is not None and not request.guided.ready:
                deferred.append(self._pop_waiting())
                continue
            cached = [] if request.scores_prompt else self.kv.find_cached_prefix(request)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, budget, prefill)
            request.num_computed_tokens = num_cached
            if not self.kv.allocate_slots(request, num_new, cached, unpin=not self.running):
                request.num_computed_tokens = 0
                break
            self._pop_waiting()
            self.kv.record_lookup(request.num_tokens, num_cached)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                request.scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
            prefill -= num_new
        for request in deferred:
            self._push_waiting(request)
        return out

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may compute: `prefill_chunk` while more than one request
        is in the scheduler (others decode, or wait to start), else the whole budget."""
        alone = len(self.running) + self._num_waiting <= 1
        if self.prefill_chunk is None or alone:
            return self.max_num_batched_tokens
        return self.prefill_chunk

    def _choose_victim(self, scheduled_ids: set[str]) -> Request:
        """The lowest-priority, latest running request not yet given tokens this step."""
        candidates = [
            r for r in self.running
            if r.request_id not in scheduled_ids and r.status is RequestStatus.RUNNING
        ]
        return max(candidates, key=lambda r: r.sort_key)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
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
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append the sampled tokens of step `out`, finish stopped requests.

        `sampled` may hold ids that did not sample this step (they are ignored). Returns
        the requests that got a token (finished ones included), and those that only
        scored their prompt (max_tokens 0), finished without one.
        """
        now = time.monotonic()
        advanced: list[Request] = []
        self.num_computed_tokens_total += out.num_batched_tokens
        for request, _ in out.scheduled:
            if request.request_id in out.scored and request.status is RequestStatus.RUNNING:
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                advanced.append(request)
                continue
            if request.request_id not in out.sampling:
                continue  # a prefill chunk: no token yet
            if request.status is not RequestStatus.RUNNING:
                continue  # finished (aborted) or preempted since it was scheduled
            request.num_pending -= 1
            request.append_token(sampled[request.request_id])
            if request.first_token_time is None:
                request.first_token_time = now
            status = request.check_stop()
            if status is not None:
                self._finish(request, status)
            advanced.append(request)
        return advanced

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
        self.kv.free(request)
        request.status = status
        request.finished_time = time.monotonic()
        del self.requests[request.request_id]
