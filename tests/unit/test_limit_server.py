"""The parent's limiter over a Unix socket: several clients (the workers) share exactly one
set of buckets; a client that vanishes gives its slots back; a server that is gone is a
503 at the gateway, as a dead Redis is."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tokenyard.errors import APIError
from tokenyard.gateway.billing import Billing
from tokenyard.gateway.gate import Gateway
from tokenyard.gateway.limit_server import LimiterUnavailable, LimitServer, SocketLimiter
from tokenyard.gateway.limits import InProcessLimiter, Limits, RateLimited, Subject
from tokenyard.store import Database, LedgerWriter, Store
from tokenyard.telemetry.timeline import Timeline


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(rpm: int | None = None, tpm: int | None = None, conc: int | None = None) -> Subject:
    return Subject("key", "key_x", Limits(rpm, tpm, conc))


def org(rpm: int | None = None, tpm: int | None = None, conc: int | None = None) -> Subject:
    return Subject("org", "org_y", Limits(rpm, tpm, conc))


Scenario = Callable[[LimitServer, SocketLimiter, SocketLimiter], Awaitable[None]]


def run(tmp_path: Path, scenario: Scenario, clock: FakeClock | None = None) -> None:
    """`scenario` with a server (on a fake clock) and two clients, the two workers."""
    async def main() -> None:
        server = LimitServer(tmp_path / "limits.sock", InProcessLimiter(clock=clock or FakeClock()))
        await server.start()
        a, b = SocketLimiter(server.path), SocketLimiter(server.path)
        try:
            await scenario(server, a, b)
        finally:
            await a.close()
            await b.close()
            await server.close()

    asyncio.run(main())


def test_two_clients_share_one_rpm_bucket_exactly(tmp_path: Path) -> None:
    async def scenario(server: LimitServer, a: SocketLimiter, b: SocketLimiter) -> None:
        outcomes = await asyncio.gather(
            *((a if i % 2 else b).admit([key(rpm=5)], 0) for i in range(12)),
            return_exceptions=True)
        admitted = [o for o in outcomes if not isinstance(o, BaseException)]
        refused = [o for o in outcomes if isinstance(o, RateLimited)]
        assert len(admitted) == 5 and len(refused) == 7, outcomes
        # The refusal is the in-process limiter's own, field for field.
        reference = InProcessLimiter(clock=FakeClock())
        for _ in range(5):
            reference.admit_now([key(rpm=5)], 0)
        with pytest.raises(RateLimited) as expected:
            reference.admit_now([key(rpm=5)], 0)
        got = refused[0]
        assert (got.scope, got.subject_id, got.kind, got.limit, got.used, got.requested,
                got.retry_after, got.state, str(got)) == (
            expected.value.scope, expected.value.subject_id, expected.value.kind,
            expected.value.limit, expected.value.used, expected.value.requested,
            expected.value.retry_after, expected.value.state, str(expected.value))
        assert sorted(o.state.remaining_requests for o in admitted) == [0, 1, 2, 3, 4]
        assert {o.state.limit_requests for o in admitted} == {5}

    run(tmp_path, scenario)


def test_a_later_attempt_of_a_counted_request_takes_no_request(tmp_path: Path) -> None:
    async def scenario(server: LimitServer, a: SocketLimiter, b: SocketLimiter) -> None:
        assert (await a.admit([key(rpm=1)], 0)).state.remaining_requests == 0
        again = await b.admit([key(rpm=1)], 0, requests=0)
        assert again.state.remaining_requests == 0
        with pytest.raises(RateLimited):
            await a.admit([key(rpm=1)], 0)

    run(tmp_path, scenario)


def test_slots_and_token_refunds_follow_settle_across_clients(tmp_path: Path) -> None:
    async def scenario(server: LimitServer, a: SocketLimiter, b: SocketLimiter) -> None:
        subjects = [key(tpm=100, conc=1), org(rpm=50)]
        held = await a.admit(subjects, 90)
        with pytest.raises(RateLimited) as busy:
            await b.admit(subjects, 1)
        assert busy.value.kind == "concurrency"
        await a.settle(held, 30)  # 60 tokens come back, the slot is free
        await a.settle(held, 0)  # a second settle changes nothing
        second = await b.admit(subjects, 70)
        assert second.state.remaining_tokens == 0
        assert second.state.remaining_requests == 48
        await b.settle(second, 70)
        with pytest.raises(RateLimited) as tokens:
            await a.admit(subjects, 1)
        assert tokens.value.kind == "tokens"

    run(tmp_path, scenario)


def test_a_client_that_vanishes_gives_its_slots_back(tmp_path: Path) -> None:
    async def scenario(server: LimitServer, a: SocketLimiter, b: SocketLimiter) -> None:
        await a.admit([key(conc=2, tpm=100)], 40)
        await a.admit([key(conc=2, tpm=100)], 40)
        with pytest.raises(RateLimited):
            await b.admit([key(conc=2, tpm=100)], 0)
        await a.close()  # as a SIGKILLed worker's socket closes
        for _ in range(200):
            if server.clients == 1:
                break
            await asyncio.sleep(0.01)
        admission = await b.admit([key(conc=2, tpm=100)], 10)
        # Both slots came back; the dead worker's 80 reserved tokens stay spent.
        assert admission.state.remaining_tokens == 10
        await b.admit([key(conc=2, tpm=100)], 0)

    run(tmp_path, scenario)


def test_a_malformed_call_is_an_error_and_the_connection_lives_on(tmp_path: Path) -> None:
    async def scenario(server: LimitServer, a: SocketLimiter, b: SocketLimiter) -> None:
        reader, writer = await asyncio.open_unix_connection(server.path)
        writer.write(b'{"id": 1, "op": "admit", "tokens": 1}\nnot json\n'
                     b'{"id": 3, "op": "admit", "tokens": 2, "subjects": []}\n')
        replies = [await reader.readline() for _ in range(3)]
        assert b"malformed" in replies[0] and b'"id":1' in replies[0]
        assert b"malformed" in replies[1]
        assert b'"lease"' in replies[2] and b'"id":3' in replies[2]
        writer.close()
        with pytest.raises(LimiterUnavailable, match="unknown op"):
            await a.call({"op": "nothing"})
        await a.admit([key(rpm=1)], 0)  # the same client goes on

    run(tmp_path, scenario)


def test_a_server_that_is_gone_then_back(tmp_path: Path) -> None:
    path = tmp_path / "limits.sock"

    async def scenario() -> None:
        client = SocketLimiter(path)
        with pytest.raises(LimiterUnavailable, match="unreachable"):
            await client.admit([key(rpm=1)], 0)
        server = LimitServer(path)
        await server.start()
        await client.admit([key(rpm=1)], 0)
        await server.close()
        with pytest.raises(LimiterUnavailable):
            await client.admit([key(rpm=1)], 0)
        server = LimitServer(path)  # a new parent, fresh buckets: the client reconnects
        await server.start()
        await client.admit([key(rpm=1)], 0)
        await client.close()
        await server.close()
        assert not os.path.exists(path)

    asyncio.run(scenario())


def test_the_gateway_answers_503_when_the_parent_limiter_is_gone(tmp_path: Path) -> None:
    async def scenario() -> APIError:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'g.db'}")
        store = Store(db)
        org_record = await store.create_org("acme")
        secret, _ = await store.create_api_key(org_record.id, name="k", rpm=10)
        ledger = LedgerWriter(db, tmp_path / "journal")
        await ledger.start()
        limiter = SocketLimiter(tmp_path / "nobody.sock")
        gateway = Gateway(store, limiter, Billing(store, ledger))
        try:
            key_context = await gateway.authenticate(
                {"authorization": f"Bearer {secret}"}, Timeline())
            with pytest.raises(APIError) as refused:
                await gateway.admit(key_context, model="m", endpoint="/v1/chat/completions",
                                    request_id="r1", prompt_tokens=5, max_tokens=5,
                                    timeline=Timeline())
            return refused.value
        finally:
            await gateway.close()

    err = asyncio.run(scenario())
    assert err.status == 503 and err.headers["retry-after"] == "1"
    assert "rate limiter" in err.message
