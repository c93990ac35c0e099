"""Stage 5: the in-process rate limiter's token buckets, on a fake clock."""

from __future__ import annotations

import asyncio
import math

import pytest

from tokenyard.cli.serve import make_limiter
from tokenyard.gateway.limits import (
    Admission,
    InProcessLimiter,
    Limits,
    RateLimited,
    RateLimitState,
    Subject,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def limiter(clock: FakeClock) -> InProcessLimiter:
    return InProcessLimiter(clock=clock)


def key(rpm: int | None = None, tpm: int | None = None, conc: int | None = None) -> Subject:
    return Subject("key", "key_x", Limits(rpm, tpm, conc))


def org(rpm: int | None = None, tpm: int | None = None, conc: int | None = None) -> Subject:
    return Subject("org", "org_y", Limits(rpm, tpm, conc))


def admit(limiter: InProcessLimiter, subjects: list[Subject], tokens: int = 0) -> Admission:
    return asyncio.run(limiter.admit(subjects, tokens))


def refusal(limiter: InProcessLimiter, subjects: list[Subject], tokens: int = 0) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        admit(limiter, subjects, tokens)
    return info.value


def test_rpm_bucket_admits_exactly_the_limit_then_refuses_with_retry_after(
    limiter: InProcessLimiter,
) -> None:
    for n in range(50):
        assert admit(limiter, [key(rpm=50)]).state.remaining_requests == 49 - n
    refused = refusal(limiter, [key(rpm=50)])
    assert (refused.kind, refused.limit, refused.used, refused.requested) == ("requests", 50, 50, 1)
    assert refused.retry_after == pytest.approx(60 / 50)  # one request refills in 1.2 s


def test_a_later_attempt_of_a_counted_request_takes_no_request(
    limiter: InProcessLimiter,
) -> None:
    assert admit(limiter, [key(rpm=1, tpm=100)], 10).state.remaining_requests == 0
    again = asyncio.run(limiter.admit([key(rpm=1, tpm=100)], 10, requests=0))
    assert (again.state.remaining_requests, again.state.remaining_tokens) == (0, 80)
    assert refusal(limiter, [key(rpm=1)]).kind == "requests"
    with pytest.raises(ValueError):
        asyncio.run(limiter.admit([key(rpm=1)], 0, requests=2))


def test_rpm_bucket_refills_at_limit_per_60_seconds_up_to_the_limit(clock: FakeClock) -> None:
    limiter = InProcessLimiter(clock=clock, sweep_interval=math.inf)  # the bucket itself caps
    for _ in range(60):
        admit(limiter, [key(rpm=60)])
    clock.now += 0.99
    assert refusal(limiter, [key(rpm=60)]).retry_after == pytest.approx(0.01)
    clock.now += 0.01
    admit(limiter, [key(rpm=60)])
    clock.now += 10.0  # ten more
    for _ in range(10):
        admit(limiter, [key(rpm=60)])
    refusal(limiter, [key(rpm=60)])
    clock.now += 3600.0  # never above the capacity: one minute's burst
    states = [admit(limiter, [key(rpm=60)]).state for _ in range(60)]
    assert states[-1].remaining_requests == 0
    refusal(limiter, [key(rpm=60)])


def test_tpm_reserves_prompt_plus_max_tokens_and_settle_refunds_the_unused_part(
    limiter: InProcessLimiter,
) -> None:
    first = admit(limiter, [key(tpm=1000)], tokens=300)
    assert first.tokens == 300 and first.state.remaining_tokens == 700
    second = admit(limiter, [key(tpm=1000)], tokens=300)
    asyncio.run(limiter.settle(first, 120))
    asyncio.run(limiter.settle(second, 80))
    state = admit(limiter, [key(tpm=1000)], tokens=0).state
    assert state.remaining_tokens == 1000 - 120 - 80
    assert state.limit_tokens == 1000


def test_settle_above_the_reservation_takes_the_difference_and_leaves_debt(
    limiter: InProcessLimiter, clock: FakeClock,
) -> None:
    asyncio.run(limiter.settle(admit(limiter, [key(tpm=600)], tokens=500), 700))
    refused = refusal(limiter, [key(tpm=600)], tokens=10)
    assert refused.used == 700  # 100 tokens of debt beyond the limit
    assert refused.retry_after == pytest.approx(110 / 10)  # refills 10 tokens per second
    clock.now += 11.0
    admit(limiter, [key(tpm=600)], tokens=10)


def test_a_second_settle_of_the_same_admission_does_nothing(limiter: InProcessLimiter) -> None:
    subjects = [key(tpm=1000, conc=2)]
    held = admit(limiter, subjects, tokens=100)
    done = admit(limiter, subjects, tokens=400)
    asyncio.run(limiter.settle(done, 0))
    asyncio.run(limiter.settle(done, 0))  # must neither refund again nor free held's slot
    assert admit(limiter, subjects, tokens=0).state.remaining_tokens == 900
    assert refusal(limiter, subjects).kind == "concurrency"
    asyncio.run(limiter.settle(held, 100))


def test_a_refusal_by_the_org_leaves_the_key_buckets_untouched(limiter: InProcessLimiter) -> None:
    subjects = [key(rpm=10, tpm=1000, conc=5), org(rpm=100, tpm=150)]
    admit(limiter, subjects, tokens=100)
    for _ in range(3):
        refused = refusal(limiter, subjects, tokens=100)
        assert (refused.scope, refused.subject_id, refused.kind) == ("org", "org_y", "tokens")
    state = admit(limiter, [key(rpm=10, tpm=1000, conc=5)], tokens=0).state
    assert (state.remaining_requests, state.remaining_tokens) == (8, 900)  # 1 + this one
    # and the key's concurrency: 2 admitted, 3 slots left
    for _ in range(3):
        admit(limiter, [key(rpm=10, tpm=1000, conc=5)])
    assert refusal(limiter, [key(rpm=10, tpm=1000, conc=5)]).kind == "concurrency"


def test_concurrency_slots_are_held_until_settle(limiter: InProcessLimiter) -> None:
    subjects = [key(conc=2), org(conc=3)]
    first, second = admit(limiter, subjects), admit(limiter, subjects)
    refused = refusal(limiter, subjects)
    assert (refused.scope, refused.kind, refused.limit, refused.used) == (
        "key", "concurrency", 2, 2)
    assert refused.retry_after == 1.0
    asyncio.run(limiter.settle(first, 0))
    third = admit(limiter, subjects)
    # the org counts the same slots: 2 in flight, plus one for another key of the org
    other_key = Subject("key", "key_z", Limits(max_concurrency=5))
    admit(limiter, [other_key, org(conc=3)])
    refused = refusal(limiter, [other_key, org(conc=3)])
    assert (refused.scope, refused.used) == ("org", 3)
    for admission in (second, third):
        asyncio.run(limiter.settle(admission, 0))
    admit(limiter, [other_key, org(conc=3)])


def test_a_reservation_above_the_whole_tpm_limit_can_never_succeed(
    limiter: InProcessLimiter, clock: FakeClock,
) -> None:
    refused = refusal(limiter, [key(tpm=1000)], tokens=1200)
    assert refused.never_fits and refused.retry_after > 0
    assert "Request too large for key key_x on tokens per min (TPM)" in str(refused)
    assert "Limit 1000, Requested 1200" in str(refused) and "never be admitted" in str(refused)
    clock.now += 3600.0
    assert refusal(limiter, [key(tpm=1000)], tokens=1200).never_fits
    assert admit(limiter, [key(tpm=1000)], tokens=1000).state.remaining_tokens == 0
    # it is reported before any wait, however long: waiting cannot help
    admit(limiter, [org(rpm=1)])
    refused = refusal(limiter, [key(tpm=2000), org(rpm=1)], tokens=2100)
    assert (refused.scope, refused.retry_after) == ("key", 60.0) and refused.never_fits


def test_rate_limited_message_names_limit_used_requested_and_wait(
    limiter: InProcessLimiter,
) -> None:
    admit(limiter, [key(tpm=1000)], tokens=950)
    refused = refusal(limiter, [key(tpm=1000)], tokens=200)
    assert (refused.used, refused.requested) == (950, 200)
    assert str(refused) == (
        "Rate limit reached for key key_x on tokens per min (TPM): Limit 1000, Used 950, "
        "Requested 200. Please try again in 9.0s."
    )
    assert not refused.never_fits


def test_the_refusal_reported_is_the_one_with_the_longest_wait(limiter: InProcessLimiter) -> None:
    subjects = [key(rpm=1, tpm=100), org(rpm=60, tpm=100)]
    admit(limiter, subjects, tokens=100)
    refused = refusal(limiter, subjects, tokens=50)
    # key: requests 60 s, tokens 30 s; org: tokens 30 s
    assert (refused.scope, refused.kind, refused.retry_after) == ("key", "requests", 60.0)


def test_header_state_comes_from_the_most_constraining_subject(
    limiter: InProcessLimiter, clock: FakeClock,
) -> None:
    subjects = [key(rpm=100, tpm=10_000), org(rpm=20, tpm=100_000)]
    state = admit(limiter, subjects, tokens=6000).state
    assert state == RateLimitState(
        limit_requests=20, remaining_requests=19, reset_requests=pytest.approx(3.0),
        limit_tokens=10_000, remaining_tokens=4000, reset_tokens=pytest.approx(36.0),
    )
    # a refusal carries the same state, before anything is taken
    refused = refusal(limiter, subjects, tokens=5000)
    assert (refused.state.remaining_requests, refused.state.remaining_tokens) == (19, 4000)
    # unlimited kinds report None
    assert admit(limiter, [org(rpm=5)]).state.limit_tokens is None
    assert admit(limiter, [Subject("key", "k", Limits())], 10**9).state == RateLimitState()


def test_subjects_with_full_buckets_and_nothing_in_flight_are_forgotten(clock: FakeClock) -> None:
    limiter = InProcessLimiter(clock=clock, sweep_interval=60.0)
    for i in range(100):
        admit(limiter, [Subject("key", f"k{i}", Limits(rpm=60, tpm=6000))], tokens=10)
    held = admit(limiter, [org(conc=1)])  # in flight: kept however long it runs
    assert len(limiter) == 101
    clock.now += 30.0
    admit(limiter, [key(rpm=60)])
    clock.now += 31.0  # the 100 keys are full again and a sweep is due
    admit(limiter, [key(rpm=1)])
    assert len(limiter) == 2  # the org holding a slot, key_x whose bucket is not full
    assert refusal(limiter, [org(conc=1)]).kind == "concurrency"
    asyncio.run(limiter.settle(held, 0))
    clock.now += 60.0
    admit(limiter, [])
    assert len(limiter) == 0


def test_make_limiter_without_redis_is_in_process() -> None:
    assert isinstance(make_limiter(None), InProcessLimiter)
