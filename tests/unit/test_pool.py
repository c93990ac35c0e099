"""Stage 12: the balancer's pool over in-process members (plain objects with async
generate/health/close: the pool takes any client), and the prefix hashes it routes on.

Every scenario ends by checking that no lease leaked: each member's in-flight count and
tokens, and the pool's, are back to zero."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from tokenyard.balancer.affinity import LocalAffinity, prefix_hashes
from tokenyard.balancer.health import record_failure
from tokenyard.balancer.pool import Pool
from tokenyard.balancer.replica_client import (
    ReplicaConnectionError,
    ReplicaOverloaded,
    ReplicaStreamError,
)
from tokenyard.deployments import BalancerSpec
from tokenyard.telemetry.timeline import Timeline
from tokenyard.wire.sampling_params import SamplingParams

PROMPT = list(range(100, 164))  # four blocks of 16


class FakeReplica:
    """A member: streams `items` tokens, each after the first only once `gate` lets it
    (when set); fails as told; answers "full" beyond `capacity` running requests."""

    def __init__(self, name: str, *, items: int = 3, capacity: int | None = None) -> None:
        self.name = name
        self.items = items
        self.capacity = capacity
        self.running = 0
        self.calls: list[str] = []
        self.fail_before: type[Exception] | None = None
        self.fail_message = "replica went away"
        self.fail_after_first = False
        self.healthy = True
        self.gate: asyncio.Event | None = None
        self.busy: asyncio.Event | None = None
        self.closed = False

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       cache_salt: str | None = None, priority: int = 0,
                       **extra: Any) -> AsyncIterator[str]:
        self.calls.append(request_id)
        if self.fail_before is not None:
            raise self.fail_before(self.fail_message)
        if self.capacity is not None and self.running >= self.capacity:
            raise ReplicaOverloaded(0.1, "queue full", "overloaded")
        self.running += 1
        try:
            for i in range(self.items):
                if i and self.fail_after_first:
                    raise ReplicaStreamError("broke mid-stream", "internal_error")
                if i and self.gate is not None:
                    await self.gate.wait()
                yield f"{self.name}:{request_id}:{i}"
        finally:
            self.running -= 1

    async def health(self) -> bool:
        if self.busy is not None:  # its loop is held up: no answer before the probe's end
            await self.busy.wait()
        return self.healthy

    async def close(self) -> None:
        self.closed = True


def make_pool(*replicas: FakeReplica, **spec: Any) -> Pool:
    spec.setdefault("health_interval_s", 0)  # no background loop: tests call check_health
    return Pool("dep", [(r.name, r) for r in replicas], BalancerSpec(**spec))


def open_stream(pool: Pool, request_id: str, prompt: list[int] = PROMPT, *,
                max_tokens: int = 16, priority: int = 0,
                timeline: Timeline | None = None) -> AsyncIterator[Any]:
    return pool.generate(request_id, prompt, SamplingParams(max_tokens=max_tokens),
                         priority=priority, timeline=timeline)


async def collect(pool: Pool, request_id: str, prompt: list[int] = PROMPT,
                  **kwargs: Any) -> list[str]:
    return [item async for item in open_stream(pool, request_id, prompt, **kwargs)]


def assert_no_leases(pool: Pool) -> None:
    assert pool.inflight == 0
    for m in pool.members:
        assert (m.id, m.inflight, m.inflight_tokens) == (m.id, 0, 0)
    assert not pool._owner


def served_by(items: list[str]) -> str:
    return items[0].split(":")[0]


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(fn())


# ---------------------------------------------------------------------------- prefix hashes


def test_prefix_hashes_equal_prefixes_share_leading_hashes() -> None:
    a = prefix_hashes(PROMPT, 16)
    b = prefix_hashes([*PROMPT[:40], 7, 7, 7, *PROMPT[43:]], 16)
    assert len(a) == len(b) == 4
    assert a[:2] == b[:2]  # blocks 0 and 1 are equal
    assert a[2] != b[2] and a[3] != b[3]  # each hash covers every token before it
    assert prefix_hashes(PROMPT[:15], 16) == []  # no full block
    assert prefix_hashes([*PROMPT, 1, 2, 3], 16) == a  # a partial tail block adds nothing


def test_prefix_hashes_salt_separates_tenants() -> None:
    plain = prefix_hashes(PROMPT, 16)
    org_a = prefix_hashes(PROMPT, 16, "org-a")
    assert org_a == prefix_hashes(PROMPT, 16, "org-a")
    assert not set(org_a) & set(plain)
    assert not set(org_a) & set(prefix_hashes(PROMPT, 16, "org-b"))


def test_local_affinity_is_bounded_and_forgets() -> None:
    async def scenario() -> None:
        table = LocalAffinity(max_entries=4)
        hashes = prefix_hashes(PROMPT, 16)
        await table.record(hashes, "a")
        assert await table.lookup(hashes) == {"a": 4}
        await table.record(hashes[:2], "b")  # b served a shorter prefix since
        assert await table.lookup(hashes) == {"b": 2, "a": 4}
        other = prefix_hashes([1] * 32, 16)
        await table.record(other, "c")
        assert len(table) == 4
        table.forget("c")
        assert await table.lookup(other) == {}

    run(scenario)


# ---------------------------------------------------------------------------- selection


def test_affinity_sends_a_conversation_back_to_its_holder() -> None:
    async def scenario() -> None:
        a, b = FakeReplica("a"), FakeReplica("b")
        pool = make_pool(a, b, policy="affinity")
        first = served_by(await collect(pool, "t1"))
        for turn in range(2, 6):  # later turns extend the prompt
            prompt = PROMPT + list(range(turn * 16))
            assert served_by(await collect(pool, f"t{turn}", prompt)) == first
        assert pool.affinity_hits == 4
        assert_no_leases(pool)

    run(scenario)


def test_slack_overrides_a_hot_holder() -> None:
    async def scenario() -> None:
        a, b = FakeReplica("a"), FakeReplica("b")
        pool = make_pool(a, b, policy="affinity")
        holder = served_by(await collect(pool, "warm"))
        for r in (a, b):
            r.gate = asyncio.Event()
        # A long request on the holder: far more outstanding tokens than the other's 0.
        hot = open_stream(pool, "hot", max_tokens=10_000)
        assert served_by([await hot.__anext__()]) == holder
        nxt = open_stream(pool, "next")
        item = await nxt.__anext__()
        assert served_by([item]) != holder  # the slack rule beat the prefix
        for r in (a, b):
            assert r.gate is not None
            r.gate.set()
        assert [x async for x in hot] and [x async for x in nxt]
        assert_no_leases(pool)

    run(scenario)


def test_least_prefers_fewest_tokens_in_flight() -> None:
    async def scenario() -> None:
        a, b = FakeReplica("a"), FakeReplica("b")
        a.gate = asyncio.Event()
        pool = make_pool(a, b, policy="least")
        big = open_stream(pool, "big", max_tokens=500)
        assert served_by([await big.__anext__()]) == "a"  # both idle: the first
        assert served_by(await collect(pool, "small", [1] * 20)) == "b"
        a.gate.set()
        await big.aclose()
        assert_no_leases(pool)

    run(scenario)


def test_round_robin_rotates_regardless_of_prefix() -> None:
    async def scenario() -> None:
        a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
        pool = make_pool(a, b, c, policy="round_robin")
        seen = [served_by(await collect(pool, f"r{i}")) for i in range(6)]
        assert seen == ["a", "b", "c", "a", "b", "c"]
        assert pool.affinity_hits == 0
        assert_no_leases(pool)

    run(scenario)


def test_the_decision_is_the_timeline_balance_stage() -> None:
    async def scenario() -> None:
        pool = make_pool(FakeReplica("a"), FakeReplica("b"))
        timeline = Timeline()
        await collect(pool, "t", timeline=timeline)
        assert "balance" in timeline.durations_ns()
        assert "balance;dur=" in timeline.server_timing()

    run(scenario)


# ---------------------------------------------------------------------------- failover


def test_failover_before_the_first_byte() -> None:
    async def scenario() -> None:
        a, b = FakeReplica("a"), FakeReplica("b")
        a.fail_before = ReplicaConnectionError
        pool = make_pool(a, b, policy="round_robin")
        items = await collect(pool, "r1")
        assert served_by(items) == "b" and len(items) == 3
        assert a.calls == ["r1"] and b.calls == ["r1"]
        assert pool.members[0].failed == 1 and pool.members[1].served == 1
        assert_no_leases(pool)

    run(scenario)


def test_every_member_failing_raises_the_last_error_once_each() -> None:
    async def scenario() -> None:
        a, b = FakeReplica("a"), FakeReplica("b")
        a.fail_before = b.fail_before = ReplicaConnectionError
        pool = make_pool(a, b)
        with pytest.raises(ReplicaConnectionError):
            await collect(pool, "r1")
        assert a.calls == ["r1"] and b.calls == ["r1"]  # each tried once
        assert_no_leases(pool)

    run(scenario)


def test_no_failover_after_the_first_item() -> None:
    async def scenario() -> None:
        a, b = FakeReplica("a"), FakeReplica("b")
        a.fail_after_first = True
        pool = make_pool(a, b, policy="round_robin")
        got: list[str] = []
        with pytest.raises(ReplicaStreamError):
            async for item in open_stream(pool, "r1"):
                got.append(item)
        assert got == ["a:r1:0"]
        assert b.calls == []  # never retried once bytes went out
        assert pool.members[0].failed == 1
        assert_no_leases(pool)

    run(scenario)


def test_a_draining_member_is_skipped_without_counting_a_failure() -> None:
    async def scenario() -> None:
        a, b = FakeReplica("a"), FakeReplica("b")
        pool = make_pool(a, b, policy="round_robin")
        assert pool.drain("a")
        assert {served_by(await collect(pool, f"r{i}")) for i in range(3)} == {"b"}
        assert pool.snapshot()[0]["state"] == "draining"
        assert pool.drain("a", False) and not pool.drain("zzz")
        assert {served_by(await collect(pool, f"s{i}")) for i in range(4)} == {"a", "b"}
        assert_no_leases(pool)

    run(scenario)


# ---------------------------------------------------------------------------- ejection


def test_ejection_after_consecutive_failures_then_readmission() -> None:
    async def scenario() -> None:
        a, b = FakeReplica("a"), FakeReplica("b")
        a.fail_before = ReplicaConnectionError
        a.fail_message = "server error 502"  # not a refused connection: passive only
        pool = make_pool(a, b, policy="round_robin", eject_after=2, eject_base_s=0.3)
        for i in range(4):
            assert served_by(await collect(pool, f"r{i}")) == "b"
        # a was tried while it failed: twice, then ejected, so no longer tried.
        assert len(a.calls) == 2
        snap = {s["id"]: s for s in pool.snapshot()}
        assert snap["a"]["state"] == "ejected" and snap["a"]["ejections"] == 1
        assert 0 < snap["a"]["ejected_for_s"] <= 0.3
        a.fail_before = None  # it recovers; the back-off still holds it out
        await collect(pool, "during")
        assert len(a.calls) == 2
        await asyncio.sleep(0.35)
        await pool.check_health()
        seen = {served_by(await collect(pool, f"after{i}")) for i in range(2)}
        assert seen == {"a", "b"}
        assert_no_leases(pool)

    run(scenario)


def test_a_refused_connection_marks_down_until_health_passes() -> None:
    async def scenario() -> None:
        a, b = FakeReplica("a"), FakeReplica("b")
        a.fail_before = ReplicaConnectionError
        a.fail_message = "Cannot connect to host 127.0.0.1:9 (connection refused)"
        pool = make_pool(a, b, policy="round_robin", eject_after=5)
        assert served_by(await collect(pool, "r0")) == "b"
        assert pool.snapshot()[0]["state"] == "unhealthy"  # down at once, not after 5
        a.fail_before = None
        a.healthy = False
        await pool.check_health()
        assert {served_by(await collect(pool, f"r{i}")) for i in range(1, 4)} == {"b"}
        a.healthy = True  # the process is back: its health check passes
        await pool.check_health()
        assert {served_by(await collect(pool, f"s{i}")) for i in range(4)} == {"a", "b"}
        assert await pool.health()
        assert_no_leases(pool)

    run(scenario)


def test_one_unanswered_probe_keeps_a_busy_replica_two_in_a_row_take_it_out() -> None:
    """A loaded host's replica may miss a probe while it computes (issue 40: the only
    replica went unhealthy under load and a well-behaved stream failed); a refusal still
    takes it out at once (the test above), silence only when it lasts."""
    async def scenario() -> None:
        a = FakeReplica("a")
        pool = make_pool(a)  # the probe waits max(0.5, interval) s for an answer
        a.busy = asyncio.Event()
        await pool.check_health()
        assert pool.snapshot()[0]["state"] == "healthy"
        assert served_by(await collect(pool, "r0")) == "a"
        await pool.check_health()
        assert pool.snapshot()[0]["state"] == "unhealthy"  # two silent probes in a row
        a.busy.set()
        await pool.check_health()
        assert pool.snapshot()[0]["state"] == "healthy"
        assert_no_leases(pool)

    run(scenario)


async def _ejected_once() -> tuple[FakeReplica, Pool]:
    """A lone replica answering 502, ejected by its first failure for 0.1 s."""
    a = FakeReplica("a")
    a.fail_before = ReplicaConnectionError
    a.fail_message = "server error 502"
    pool = make_pool(a, eject_after=1, eject_base_s=0.1)
    with pytest.raises(ReplicaConnectionError):
        await collect(pool, "r0")
    return a, pool


def test_back_off_doubles_for_consecutive_ejections() -> None:
    async def scenario() -> None:
        _, pool = await _ejected_once()
        first = pool.snapshot()[0]["ejected_for_s"]
        await asyncio.sleep(0.12)
        with pytest.raises(ReplicaConnectionError):
            await collect(pool, "r1")
        second = pool.snapshot()[0]["ejected_for_s"]
        assert first <= 0.1 < second <= 0.2
        with pytest.raises(ReplicaConnectionError, match="no replica"):
            await collect(pool, "r2")  # ejected: nothing to try
        assert_no_leases(pool)

    run(scenario)


def test_failures_reported_while_ejected_do_not_extend_the_ejection() -> None:
    """One incident (a replica killed under many streams) ejects once: the requests that
    were on it when it failed report in afterwards, and used to double the ejection per
    batch of `eject_after` of them, up to the cap."""
    async def scenario() -> None:
        a, b = FakeReplica("a"), FakeReplica("b")
        pool = make_pool(a, b, policy="round_robin", eject_after=2, eject_base_s=5.0)
        member = next(m for m in pool.members if m.id == "a")
        spec = pool.spec
        for _ in range(10):
            record_failure(member, ReplicaConnectionError("stream broke"), spec, "p",
                           before_first_byte=False)
        snap = pool.snapshot()[0]
        assert (snap["state"], snap["ejections"]) == ("ejected", 1)
        assert snap["ejected_for_s"] <= 5.0
        assert_no_leases(pool)

    run(scenario)


def test_a_success_ends_the_run_of_ejections() -> None:
    async def scenario() -> None:
        a, pool = await _ejected_once()
        await asyncio.sleep(0.12)
        a.fail_before = None
        assert served_by(await collect(pool, "ok")) == "a"
        a.fail_before = ReplicaConnectionError
        with pytest.raises(ReplicaConnectionError):
            await collect(pool, "r1")
        snap = pool.snapshot()[0]
        assert snap["ejections"] == 1 and snap["ejected_for_s"] <= 0.1  # not doubled
        assert_no_leases(pool)

    run(scenario)


# ---------------------------------------------------------------------------- the queue


def test_a_request_waits_for_a_released_lease() -> None:
    async def scenario() -> None:
        a, b = FakeReplica("a", capacity=1), FakeReplica("b", capacity=1)
        for r in (a, b):
            r.gate = asyncio.Event()
        pool = make_pool(a, b, queue_timeout_s=5.0)
        holders = [open_stream(pool, f"h{i}") for i in range(2)]
        for h in holders:
            await h.__anext__()
        waiter = asyncio.create_task(collect(pool, "w"))
        await asyncio.sleep(0.1)
        assert not waiter.done() and len(pool._waiting._waiters) == 1
        a.gate.set()
        b.gate.set()
        started = time.monotonic()
        await holders[0].aclose()  # releases its lease: the waiter is woken
        items = await asyncio.wait_for(waiter, 2.0)
        assert len(items) == 3 and time.monotonic() - started < 0.4  # woken, not polled
        await holders[1].aclose()
        assert_no_leases(pool)

    run(scenario)


def test_waiters_are_served_in_priority_order() -> None:
    async def scenario() -> None:
        a = FakeReplica("a", capacity=1)
        a.gate = asyncio.Event()
        pool = make_pool(a, queue_timeout_s=5.0)
        holder = open_stream(pool, "holder")
        await holder.__anext__()
        order: list[str] = []

        async def request(rid: str, priority: int) -> None:
            async for _ in open_stream(pool, rid, priority=priority):
                pass
            order.append(rid)

        low = asyncio.create_task(request("low", 5))
        await asyncio.sleep(0.02)
        high = asyncio.create_task(request("high", 1))
        await asyncio.sleep(0.02)
        assert len(pool._waiting._waiters) == 2
        a.gate.set()
        await holder.aclose()
        await asyncio.wait_for(asyncio.gather(low, high), 5.0)
        assert order == ["high", "low"]  # the later but more urgent one first
        assert_no_leases(pool)

    run(scenario)


def test_waiters_of_one_class_keep_their_arrival_order() -> None:
    """Issue 29: room that comes without a release (the replica's own queue moved on)
    goes to the first in line, not to whichever waiter's half-second look fell first;
    before, each look put the waiter back with a new place (three finished 2, 3, 1)."""
    async def scenario() -> None:
        a = FakeReplica("a", capacity=1)
        a.gate = asyncio.Event()
        pool = make_pool(a, queue_timeout_s=10.0)
        holder = open_stream(pool, "holder")
        await holder.__anext__()
        started: list[str] = []

        async def request(rid: str) -> None:
            stream = open_stream(pool, rid, priority=5)
            await stream.__anext__()
            started.append(rid)
            async for _ in stream:
                pass

        t0 = time.monotonic()
        tasks = []
        for rid in ("first", "second", "third"):  # a phase apart
            tasks.append(asyncio.create_task(request(rid)))
            await asyncio.sleep(0.15)
        # Just after the first one's third look: the others' looks come sooner.
        await asyncio.sleep(t0 + 1.55 - time.monotonic())
        assert not started and len(pool._waiting) == 3
        a.capacity = 4  # room, and no lease released
        a.gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        assert started == ["first", "second", "third"]
        await holder.aclose()
        assert_no_leases(pool)

    run(scenario)


def test_a_newcomer_queues_behind_waiters_of_its_class() -> None:
    async def scenario() -> None:
        a = FakeReplica("a", capacity=1)
        a.gate = asyncio.Event()
        pool = make_pool(a, queue_timeout_s=10.0)
        holder = open_stream(pool, "holder")
        await holder.__anext__()
        started: list[str] = []

        async def request(rid: str, priority: int = 5) -> None:
            stream = open_stream(pool, rid, priority=priority)
            await stream.__anext__()
            started.append(rid)
            async for _ in stream:
                pass

        waiter = asyncio.create_task(request("waiter"))
        await asyncio.sleep(0.05)
        a.capacity = 2  # room for one, no release: the waiter looks within 0.5 s
        late = asyncio.create_task(request("late"))
        urgent = asyncio.create_task(request("urgent", priority=1))
        await asyncio.sleep(0.05)
        assert started == ["urgent"]  # a more urgent class may pass; its own class not
        a.gate.set()
        await asyncio.wait_for(asyncio.gather(waiter, late, urgent), 5.0)
        assert started == ["urgent", "waiter", "late"]
        await holder.aclose()
        assert_no_leases(pool)

    run(scenario)


def test_a_full_queue_refuses_at_once() -> None:
    async def scenario() -> None:
        a = FakeReplica("a", capacity=1)
        a.gate = asyncio.Event()
        pool = make_pool(a, queue_timeout_s=5.0, queue_max=1)
        holder = open_stream(pool, "holder")
        await holder.__anext__()
        waiter = asyncio.create_task(collect(pool, "w"))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(ReplicaOverloaded) as info:
            await collect(pool, "refused")
        assert time.monotonic() - started < 0.2
        assert info.value.code == "overloaded" and info.value.retry_after
        a.gate.set()
        await holder.aclose()
        assert len(await asyncio.wait_for(waiter, 2.0)) == 3
        assert_no_leases(pool)

    run(scenario)


def test_the_queue_times_out_with_overloaded() -> None:
    async def scenario() -> None:
        a = FakeReplica("a", capacity=1)
        a.gate = asyncio.Event()
        pool = make_pool(a, queue_timeout_s=0.3)
        holder = open_stream(pool, "holder")
        await holder.__anext__()
        started = time.monotonic()
        with pytest.raises(ReplicaOverloaded):
            await collect(pool, "late")
        assert 0.25 < time.monotonic() - started < 1.0
        assert not pool._waiting._waiters or all(f.done() for _, _, f in pool._waiting._waiters)
        a.gate.set()
        await holder.aclose()
        assert_no_leases(pool)

    run(scenario)


# ---------------------------------------------------------------------------- leases


def test_cancelled_consumers_release_their_leases() -> None:
    async def scenario() -> None:
        a, b = FakeReplica("a", capacity=1), FakeReplica("b", capacity=1)
        for r in (a, b):
            r.gate = asyncio.Event()
        pool = make_pool(a, b, queue_timeout_s=5.0)
        # Two consumers mid-stream (one blocked inside the member), one in the queue.
        streaming = [asyncio.create_task(collect(pool, f"s{i}")) for i in range(2)]
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(collect(pool, "q"))
        await asyncio.sleep(0.05)
        assert sum(m.inflight for m in pool.members) == 2 and pool.inflight == 3
        for task in (*streaming, queued):
            task.cancel()
        await asyncio.gather(*streaming, queued, return_exceptions=True)
        assert a.running == b.running == 0  # the members' streams were closed too
        assert_no_leases(pool)
        # A consumer that stops reading and closes the stream early.
        for r in (a, b):
            r.gate = None
        stream = open_stream(pool, "early")
        await stream.__anext__()
        await stream.aclose()
        assert_no_leases(pool)

    run(scenario)


def test_close_closes_every_member() -> None:
    async def scenario() -> None:
        a, b = FakeReplica("a"), FakeReplica("b")
        pool = make_pool(a, b, health_interval_s=0.05)
        pool.start()
        a.healthy = False
        await asyncio.sleep(0.2)  # the loop ran: a is out
        assert pool.snapshot()[0]["state"] == "unhealthy"
        await pool.close()
        assert a.closed and b.closed

    run(scenario)
