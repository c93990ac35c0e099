"""Stage 5 at scale-out: `RedisLimiter` against a real Redis, within one process and shared
by separate gateway processes, on TOKENYARD_REDIS_URL (default redis://127.0.0.1:6379/0).
Skipped when that Redis is unreachable; failed instead when CI is set."""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis

from tests.conftest import REDIS_URL
from tokenyard.gateway.limits import Admission, Limits, RateLimited, Subject
from tokenyard.gateway.redis_limits import RedisLimiter


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A fresh key prefix for this test; its keys are deleted afterwards."""
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=1, socket_timeout=5)
    name = f"test-limits-{uuid.uuid4().hex[:12]}:"
    yield name
    keys = list(client.scan_iter(match="{" + name + "}*"))
    if keys:
        client.delete(*keys)
    client.close()


def run(prefix: str, scenario: Callable[[RedisLimiter], Awaitable[None]], **kw: Any) -> None:
    """Run `scenario` with a RedisLimiter on `prefix`, in an event loop of its own."""

    async def main() -> None:
        limiter = RedisLimiter(REDIS_URL, prefix=prefix, **kw)
        try:
            await scenario(limiter)
        finally:
            await limiter.close()

    asyncio.run(main())


async def refusal(limiter: RedisLimiter, subjects: list[Subject], tokens: int = 0) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        await limiter.admit(subjects, tokens)
    return info.value


KEY = Subject("key", "key_x", Limits(rpm=6, tpm=60, max_concurrency=3))  # refills 0.1 req/s
ORG = Subject("org", "org_y", Limits(rpm=600, tpm=30))


def test_rpm_bucket_admits_exactly_the_limit_then_refuses(prefix: str) -> None:
    async def scenario(limiter: RedisLimiter) -> None:
        subjects = [Subject("key", "key_x", Limits(rpm=5))]
        remaining = [(await limiter.admit(subjects, 0)).state.remaining_requests for _ in range(5)]
        assert remaining == [4, 3, 2, 1, 0]
        refused = await refusal(limiter, subjects)
        assert (refused.kind, refused.limit, refused.used, refused.requested) == (
            "requests", 5, 5, 1)
        assert 11.0 < refused.retry_after <= 12.0  # one request refills in 12 s

    run(prefix, scenario)


def test_a_later_attempt_of_a_counted_request_takes_no_request(prefix: str) -> None:
    async def scenario(limiter: RedisLimiter) -> None:
        subjects = [Subject("key", "key_x", Limits(rpm=1, tpm=100, max_concurrency=2))]
        first = await limiter.admit(subjects, 10)
        assert first.state.remaining_requests == 0
        again = await limiter.admit(subjects, 10, requests=0)  # a fallback's attempt
        assert (again.state.remaining_requests, again.state.remaining_tokens) == (0, 80)
        assert (await refusal(limiter, subjects)).kind == "requests"

    run(prefix, scenario)


def test_tpm_settle_refunds_the_unused_reservation_and_is_idempotent(prefix: str) -> None:
    async def scenario(limiter: RedisLimiter) -> None:
        first = await limiter.admit([KEY], 30)
        second = await limiter.admit([KEY], 20)
        assert second.state.remaining_tokens == 10
        await limiter.settle(first, 12)
        await limiter.settle(second, 8)
        await limiter.settle(second, 8)  # neither refunds again nor frees another slot
        state = (await limiter.admit([KEY], 0)).state
        assert state.remaining_tokens == 60 - 12 - 8  # refills 1 token/s: the test takes less
        # settling above the reservation takes the difference
        third = await limiter.admit([KEY], 10)
        await limiter.settle(third, 30)
        assert (await refusal(limiter, [KEY], 20)).used == 12 + 8 + 30

    run(prefix, scenario)


def test_a_refusal_by_the_org_leaves_the_key_untouched(prefix: str) -> None:
    async def scenario(limiter: RedisLimiter) -> None:
        await limiter.admit([KEY, ORG], 20)
        for _ in range(3):
            refused = await refusal(limiter, [KEY, ORG], 20)
            assert (refused.scope, refused.subject_id, refused.kind) == ("org", "org_y", "tokens")
            assert (refused.used, refused.requested) == (20, 20)
        state = (await limiter.admit([KEY], 0)).state
        assert (state.remaining_requests, state.remaining_tokens) == (4, 40)
        await limiter.admit([KEY], 0)
        assert (await refusal(limiter, [KEY])).kind == "concurrency"  # 3 slots, 3 taken

    run(prefix, scenario)


def test_concurrency_slots_are_held_until_settle(prefix: str) -> None:
    async def scenario(limiter: RedisLimiter) -> None:
        subjects = [Subject("key", "key_x", Limits(max_concurrency=2))]
        held = [await limiter.admit(subjects, 0) for _ in range(2)]
        refused = await refusal(limiter, subjects)
        assert (refused.kind, refused.limit, refused.used, refused.retry_after) == (
            "concurrency", 2, 2, 1.0)
        await limiter.settle(held[0], 0)
        held[0] = await limiter.admit(subjects, 0)
        for admission in held:
            await limiter.settle(admission, 0)
        assert await limiter._redis.zcard(limiter.key_prefix + "key:key_x:leases") == 0

    run(prefix, scenario)


def test_oversize_reservation_and_header_state(prefix: str) -> None:
    async def scenario(limiter: RedisLimiter) -> None:
        refused = await refusal(limiter, [KEY], 61)
        assert refused.never_fits and refused.retry_after > 0
        assert "Request too large for key key_x on tokens per min (TPM): Limit 60, " \
            "Requested 61" in str(refused)
        subjects = [Subject("key", "key_x", Limits(rpm=100, tpm=10_000)),
                    Subject("org", "org_y", Limits(rpm=20, tpm=100_000))]
        state = (await limiter.admit(subjects, 6000)).state
        assert (state.limit_requests, state.remaining_requests) == (20, 19)
        assert (state.limit_tokens, state.remaining_tokens) == (10_000, 4000)
        assert state.reset_requests == pytest.approx(3.0, abs=0.1)
        assert state.reset_tokens == pytest.approx(36.0, abs=0.1)
        refused = await refusal(limiter, subjects, 4500)
        # The bucket refills ~167 tokens a second, so "Used" is 6000 less what refilled
        # between the two calls (5999 after a slow 6 ms).
        found = re.match(
            r"Rate limit reached for key key_x on tokens per min \(TPM\): Limit 10000, "
            r"Used (\d+), Requested 4500\. Please try again in ", str(refused))
        assert found and 5900 <= int(found.group(1)) <= 6000, str(refused)

    run(prefix, scenario)


def test_buckets_refill_continuously_by_server_time(prefix: str) -> None:
    async def scenario(limiter: RedisLimiter) -> None:
        subjects = [Subject("key", "key_x", Limits(tpm=60_000))]  # 1000 tokens per second
        started = time.monotonic()
        await limiter.admit(subjects, 60_000)
        await asyncio.sleep(0.3)
        remaining = (await limiter.admit(subjects, 0)).state.remaining_tokens
        elapsed = time.monotonic() - started
        assert remaining is not None and 250 <= remaining <= 1000 * elapsed + 1, (
            remaining, elapsed)

    run(prefix, scenario)


def test_bucket_keys_expire_when_they_would_be_full_again(prefix: str) -> None:
    async def scenario(limiter: RedisLimiter) -> None:
        await limiter.admit([KEY], 30)  # requests: 1 of 6 (10 s to refill); tokens: 30 s
        ttl_requests = await limiter._redis.pttl(limiter.key_prefix + "key:key_x:rpm")
        ttl_tokens = await limiter._redis.pttl(limiter.key_prefix + "key:key_x:tpm")
        assert 10_000 <= ttl_requests <= 11_000 and 30_000 <= ttl_tokens <= 31_000

    run(prefix, scenario)


# One gateway process: connects, says "ready", waits for "go", fires `admits` admits at
# once, prints what it got; then crashes (never settles) or waits for a line and settles.
GATEWAY = r"""
import asyncio, json, os, sys, time
from tokenyard.gateway.limits import Admission, Limits, RateLimited, Subject
from tokenyard.gateway.redis_limits import RedisLimiter

async def main(job):
    limiter = RedisLimiter(job["url"], prefix=job["prefix"], lease_ttl=job["lease_ttl"])
    subject = Subject("key", "key_shared", Limits(*job["limits"]))
    await limiter.admit([], 0)  # connect and load the script before the start
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)

    async def one():
        try:
            return await limiter.admit([subject], 1)
        except RateLimited:
            return None

    first = time.time()
    admitted = [a for a in await asyncio.gather(*(one() for _ in range(job["admits"]))) if a]
    last = time.time()
    print(json.dumps({"admitted": len(admitted), "first": first, "last": last}), flush=True)
    if job["crash"]:
        os._exit(0)
    await asyncio.to_thread(sys.stdin.readline)
    for admission in admitted:
        await limiter.settle(admission, 1)
    await limiter.close()

asyncio.run(main(json.loads(sys.argv[1])))
"""


class Gateways:
    """Separate gateway processes running GATEWAY, started together."""

    def __init__(self, prefix: str, jobs: list[dict[str, Any]]) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", GATEWAY, json.dumps(
                    {"url": REDIS_URL, "prefix": prefix, "lease_ttl": 600.0, "crash": False,
                     "admits": 1, "limits": [None, None, None]} | job)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            for job in jobs
        ]

    def line(self, proc: subprocess.Popen[str]) -> str:
        assert proc.stdout is not None
        text = proc.stdout.readline()
        assert text, f"gateway process exited early with {proc.wait(10)}"
        return text

    def fire(self) -> list[dict[str, Any]]:
        """Wait until every process is ready, start them all, and return what each admitted."""
        for proc in self.procs:
            assert self.line(proc).strip() == "ready"
        for proc in self.procs:
            self.say(proc)
        return [json.loads(self.line(proc)) for proc in self.procs]

    def say(self, proc: subprocess.Popen[str]) -> None:
        if proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()

    def finish(self) -> None:
        for proc in self.procs:
            self.say(proc)
            assert proc.wait(10) == 0

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_two_gateway_processes_share_one_rpm_bucket(prefix: str) -> None:
    gateways = Gateways(prefix, [{"admits": 100, "limits": [50, None, None]}] * 2)
    try:
        results = gateways.fire()
        gateways.finish()
    finally:
        gateways.kill()
    admitted = sum(r["admitted"] for r in results)
    elapsed = max(r["last"] for r in results) - min(r["first"] for r in results)
    # one bucket's burst (the full minute) plus what refills while they fire
    assert 50 <= admitted <= 50 + math.floor(50 / 60 * elapsed), (admitted, elapsed)


def test_two_gateway_processes_share_the_concurrency_limit(prefix: str) -> None:
    gateways = Gateways(prefix, [{"admits": 10, "limits": [None, None, 5]}] * 2)
    try:
        results = gateways.fire()  # both hold their slots until told to settle
        assert sum(r["admitted"] for r in results) == 5
        gateways.finish()
    finally:
        gateways.kill()

    async def scenario(limiter: RedisLimiter) -> None:
        subjects = [Subject("key", "key_shared", Limits(max_concurrency=5))]
        admissions = [await limiter.admit(subjects, 0) for _ in range(5)]  # all released
        for admission in admissions:
            await limiter.settle(admission, 0)

    run(prefix, scenario)


def test_a_crashed_gateway_s_slots_free_themselves_after_the_lease_ttl(prefix: str) -> None:
    subjects = [Subject("key", "key_shared", Limits(max_concurrency=3))]
    alive: list[Admission] = []

    async def hold(limiter: RedisLimiter) -> None:  # a live lease, admitted before the crash
        alive.append(await limiter.admit(subjects, 0))

    run(prefix, hold)
    gateways = Gateways(prefix, [{"admits": 2, "limits": [None, None, 3], "lease_ttl": 1.5,
                                  "crash": True}])
    try:
        (result,) = gateways.fire()
        assert result["admitted"] == 2
        assert gateways.procs[0].wait(10) == 0  # gone without settling
    finally:
        gateways.kill()

    async def scenario(limiter: RedisLimiter) -> None:
        assert (await refusal(limiter, subjects)).used == 3
        await asyncio.sleep(max(0.0, result["last"] + 1.6 - time.time()))
        admissions = alive + [await limiter.admit(subjects, 0) for _ in range(2)]
        # the live lease outlived the crashed ones' shorter ttl
        assert (await refusal(limiter, subjects)).used == 3
        for admission in admissions:
            await limiter.settle(admission, 0)

    run(prefix, scenario)
