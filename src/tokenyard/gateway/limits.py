"""Stage 5: rate limits per API key and per org: requests and tokens per minute, concurrency.

A request is checked against every subject it belongs to (its key and its org) at once and
is admitted all or nothing: one request from each RPM bucket, its token reservation
(prompt + max_tokens) from each TPM bucket and one concurrency slot per subject, or nothing
at all. When the request ends (completed, stopped, aborted or failed) `settle` gives back
the unused part of the reservation (or takes the excess when the reply used more) and
releases the slots.

Algorithm: one token bucket per (subject, kind). Its capacity is the per-minute limit and it
refills continuously at limit/60 per second; a bucket nobody has touched is full. So a
subject idle for a minute may spend its whole minute in one burst, and over any window of
t seconds at most `limit + limit/60 × t` units pass — one bucket's burst plus the refill,
never more. A settle that takes more than was reserved may leave a TPM bucket below zero;
later requests then wait until the debt has refilled.

`InProcessLimiter` keeps the buckets in a dict (the embedded default, one gateway process);
`redis_limits.RedisLimiter` keeps them in Redis so that every gateway process shares them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Literal, NamedTuple, Protocol

from tokenyard.store.records import Limits

Kind = Literal["requests", "tokens", "concurrency"]
KINDS: tuple[Kind, Kind, Kind] = ("requests", "tokens", "concurrency")

#: Seconds to suggest when every concurrency slot is taken: a slot frees whenever one of the
#: subject's requests ends, which nothing here can predict.
CONCURRENCY_RETRY_AFTER = 1.0
#: Seconds to suggest for a request that can never fit (more than a whole minute's limit).
NEVER_FITS_RETRY_AFTER = 60.0
#: Float slack when comparing bucket levels: refill arithmetic is inexact by a few ulps.
EPSILON = 1e-9

_LABELS = {
    "requests": "requests per min (RPM)",
    "tokens": "tokens per min (TPM)",
    "concurrency": "concurrent requests",
}


@dataclass(frozen=True, slots=True)
class Subject:
    """Who a limit applies to: `scope` is "key" or "org", `id` the key's or org's id."""

    scope: str
    id: str
    limits: Limits


class RateLimitState(NamedTuple):
    """What the `x-ratelimit-*` response headers report: the most constraining subject's
    request bucket and token bucket (fewest remaining). None where no subject has that limit.
    `reset_*` are seconds until that bucket is full again. (A NamedTuple: built per request,
    it costs a quarter of a frozen dataclass.)"""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float | None = None


@dataclass(slots=True, eq=False)
class Admission:
    """An admitted request's hold on its subjects' limits, until `Limiter.settle`."""

    lease_id: str
    subjects: tuple[Subject, ...]
    tokens: int  # reserved from each TPM bucket
    state: RateLimitState
    settled: bool = False


class RateLimited(Exception):
    """A request refused by one subject's limit (the one with the longest wait).

    `kind` is "requests", "tokens" or "concurrency"; `used` is what the subject has in use now
    (it may exceed `limit` after a settle took more than was reserved); `requested` is what
    this request asked for; `retry_after` is seconds until it would fit (> 0)."""

    def __init__(
        self, scope: str, subject_id: str, kind: Kind, limit: int, used: int, requested: int,
        retry_after: float, state: RateLimitState,
    ) -> None:
        self.scope = scope
        self.subject_id = subject_id
        self.kind: Kind = kind
        self.limit = limit
        self.used = used
        self.requested = requested
        self.retry_after = retry_after
        self.state = state
        super().__init__(self.message())

    @property
    def never_fits(self) -> bool:
        """True when the reservation is larger than the whole TPM limit: retrying cannot help."""
        return self.kind == "tokens" and self.requested > self.limit

    def message(self) -> str:
        where = f"{self.scope} {self.subject_id} on {_LABELS[self.kind]}"
        if self.never_fits:
            return (f"Request too large for {where}: Limit {self.limit}, Requested "
                    f"{self.requested}. A reservation above the whole per-minute limit can "
                    "never be admitted: reduce the input or max_tokens.")
        return (f"Rate limit reached for {where}: Limit {self.limit}, Used {self.used}, "
                f"Requested {self.requested}. Please try again in "
                f"{_duration(self.retry_after)}.")


class Limiter(Protocol):
    """What the gateway calls per request (stage 5 before routing, stage 19 after the reply)."""

    async def admit(self, subjects: Sequence[Subject], tokens: int,
                    requests: int = 1) -> Admission:
        """Take `requests` (1; 0 for a later attempt of a request already counted),
        `tokens` (prompt + max_tokens) and one slot from every subject, or raise
        `RateLimited` and take nothing."""
        ...

    async def settle(self, admission: Admission, actual_tokens: int) -> None:
        """Settle the reservation to `actual_tokens` and release the slots; idempotent."""
        ...

    async def close(self) -> None: ...


class _Counters:
    """One subject's two buckets (level and the time of that level; level None: full) and
    its requests in flight, with the limits they were last used with (for the sweep)."""

    __slots__ = ("in_flight", "levels", "limits", "stamps")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.levels: list[float | None] = [None, None]  # requests, tokens
        self.stamps = [0.0, 0.0]
        self.in_flight = 0

    def level(self, k: int, limit: int, now: float) -> float:
        """Bucket `k`'s level at `now`, refilled at limit/60 per second up to `limit`."""
        level = self.levels[k]
        if level is None:
            return float(limit)
        level += (now - self.stamps[k]) * limit / 60.0
        return limit if level > limit else level

    def is_idle(self, now: float) -> bool:
        """Nothing in flight and both buckets full: forgetting it changes nothing."""
        limits = self.limits
        return self.in_flight == 0 and all(
            limit is None or self.levels[k] is None or self.level(k, limit, now) >= limit
            for k, limit in ((0, limits.rpm), (1, limits.tpm))
        )


class InProcessLimiter:
    """Token buckets in a dict, for one gateway process. Every call is synchronous inside:
    nothing awaits between the check and the take, so one event loop needs no locks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 sweep_interval: float = 60.0) -> None:
        """`clock`: monotonic seconds. Every `sweep_interval` seconds, subjects whose buckets
        have refilled completely and that have nothing in flight are forgotten (an absent
        bucket is a full one), so memory follows the active subjects."""
        self._clock = clock
        self._counters: dict[tuple[str, str], _Counters] = {}
        self._ids = count()
        self._sweep_interval = sweep_interval
        self._swept = clock()

    async def admit(self, subjects: Sequence[Subject], tokens: int,
                    requests: int = 1) -> Admission:
        return self.admit_now(subjects, tokens, requests)

    async def settle(self, admission: Admission, actual_tokens: int) -> None:
        self.settle_now(admission, actual_tokens)

    async def close(self) -> None:
        self._counters.clear()

    def admit_now(self, subjects: Sequence[Subject], tokens: int,
                  requests: int = 1) -> Admission:
        """`admit` without the coroutine."""
        check_amounts(tokens, requests)
        now = self._clock()
        if now - self._swept >= self._sweep_interval:
            self._sweep(now)
        subjects = tuple(subjects)
        found = [self._counters.get((subject.scope, subject.id)) for subject in subjects]
        levels: list[float | None] = []  # per subject: requests level, tokens level, in flight
        refusal: tuple[int, int, float] | None = None  # (subject index, kind index, retry)
        for i, subject in enumerate(subjects):
            limits, counters = subject.limits, found[i]
            for k, limit, amount in ((0, limits.rpm, requests), (1, limits.tpm, tokens)):
                if limit is None:
                    levels.append(None)
                    continue
                level = float(limit) if counters is None else counters.level(k, limit, now)
                levels.append(level)
                if level + EPSILON < amount:
                    retry = math.inf if amount > limit else (amount - level) * 60.0 / limit
                    if refusal is None or retry > refusal[2]:
                        refusal = (i, k, retry)
            if limits.max_concurrency is None:
                levels.append(None)
                continue
            in_flight = 0 if counters is None else counters.in_flight
            levels.append(in_flight)
            if in_flight >= limits.max_concurrency and (
                refusal is None or refusal[2] < CONCURRENCY_RETRY_AFTER
            ):
                refusal = (i, 2, CONCURRENCY_RETRY_AFTER)
        if refusal is not None:
            raise rate_limited(subjects, tokens, levels, *refusal)
        for i, subject in enumerate(subjects):
            counters = found[i]
            if counters is None:
                counters = self._counters[(subject.scope, subject.id)] = _Counters(subject.limits)
            counters.limits = subject.limits
            for k, amount in ((0, requests), (1, tokens)):
                before = levels[3 * i + k]
                if before is not None:
                    levels[3 * i + k] = counters.levels[k] = before - amount
                    counters.stamps[k] = now
            if subject.limits.max_concurrency is not None:
                counters.in_flight += 1
                levels[3 * i + 2] = counters.in_flight
        state = rate_limit_state(subjects, levels)
        return Admission(f"{next(self._ids):x}", subjects, tokens, state)

    def settle_now(self, admission: Admission, actual_tokens: int) -> None:
        """`settle` without the coroutine."""
        if admission.settled:
            return
        admission.settled = True
        now = self._clock()
        refund = admission.tokens - actual_tokens
        for subject in admission.subjects:
            limits = subject.limits
            counters = self._counters.get((subject.scope, subject.id))
            if counters is None:  # forgotten because full and idle: it holds no slot of ours
                if limits.tpm is None or refund >= 0:
                    continue  # and a full bucket takes no refund
                counters = self._counters[(subject.scope, subject.id)] = _Counters(limits)
            if limits.tpm is not None and refund:
                counters.levels[1] = min(float(limits.tpm),
                                         counters.level(1, limits.tpm, now) + refund)
                counters.stamps[1] = now
            if limits.max_concurrency is not None and counters.in_flight > 0:
                counters.in_flight -= 1

    def _sweep(self, now: float) -> None:
        self._swept = now
        idle = [key for key, counters in self._counters.items() if counters.is_idle(now)]
        for key in idle:
            del self._counters[key]

    def __len__(self) -> int:
        """Subjects held in memory (for tests and metrics)."""
        return len(self._counters)


def check_amounts(tokens: int, requests: int) -> None:
    """ValueError for amounts an admission cannot take (negative; more than one request)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, not {tokens}")
    if requests not in (0, 1):
        raise ValueError(f"requests must be 0 or 1, not {requests}")


def rate_limit_state(subjects: Sequence[Subject], levels: Sequence[float | None]) -> RateLimitState:
    """Header state from per-subject levels laid out as (requests level, tokens level, in
    flight) per subject, None where unlimited. The most constraining bucket of each kind is
    the one with the fewest remaining, ties broken by the longer reset."""
    best: list[tuple[int, float, int] | None] = [None, None]  # (remaining, reset, limit)
    for i, subject in enumerate(subjects):
        limits = subject.limits
        for k, limit in ((0, limits.rpm), (1, limits.tpm)):
            level = levels[3 * i + k]
            if limit is None or level is None:
                continue
            remaining = int(level + EPSILON) if level > 0 else 0
            reset = (limit - level) * 60.0 / limit if limit > 0 else 0.0
            current = best[k]
            if current is None or remaining < current[0] or (
                remaining == current[0] and reset > current[1]
            ):
                best[k] = (remaining, reset, limit)
    requests, tokens = best
    return RateLimitState(
        *((None, None, None) if requests is None else (requests[2], requests[0], requests[1])),
        *((None, None, None) if tokens is None else (tokens[2], tokens[0], tokens[1])),
    )


def rate_limited(
    subjects: Sequence[Subject], tokens: int, levels: Sequence[float | None],
    index: int, kind_index: int, retry_after: float,
) -> RateLimited:
    """The refusal of `subjects[index]`'s limit of kind `KINDS[kind_index]`, from the levels
    before anything was taken (layout as in `rate_limit_state`); `retry_after` may be inf
    for a request that can never fit."""
    subject = subjects[index]
    kind = KINDS[kind_index]
    limits = subject.limits
    limit = (limits.rpm, limits.tpm, limits.max_concurrency)[kind_index]
    level = levels[3 * index + kind_index]
    assert limit is not None and level is not None
    if kind == "concurrency":
        used, requested = int(level), 1
    else:
        used, requested = limit - math.floor(level + EPSILON), (1 if kind == "requests" else tokens)
    if math.isinf(retry_after):
        retry_after = NEVER_FITS_RETRY_AFTER
    return RateLimited(subject.scope, subject.id, kind, limit, used, requested,
                       max(retry_after, 0.001), rate_limit_state(subjects, levels))


def _duration(seconds: float) -> str:
    """OpenAI's style: "120ms" below a second, else "9.0s"."""
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    return f"{seconds:.1f}s"
