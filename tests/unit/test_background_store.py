"""Background responses in the store: claims under a lease, writes only while held, one
outcome, org and region scoping. Backend-neutral: tests/integration/test_store_postgres.py
runs them again on PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from tests.unit.test_responses_store import World, database_url, run  # noqa: F401
from tokenyard.gateway.background import Background, BackgroundSettings
from tokenyard.store import background as rows
from tokenyard.store.sql import utcnow


def _event(n: int, kind: str) -> dict[str, object]:
    return {"type": f"response.{kind}", "sequence_number": n}


async def _queue(background: Background, w: World, rid: str) -> None:
    await background.create(w.a, response={"id": rid, "status": "queued"}, body="{}",
                            earlier=[], events=[_event(0, "created"), _event(1, "queued")])


def test_claims_leases_writes_and_one_outcome(database_url: str) -> None:  # noqa: F811
    async def scenario(w: World) -> None:
        db = w.store.db
        here, there = Background(w.store, BackgroundSettings()), Background(
            w.store, BackgroundSettings(), region="eu")
        await _queue(here, w, "resp_1")
        await _queue(there, w, "resp_2")
        assert await here.get(w.b, "resp_1") is None  # another org's: not found
        now = utcnow()
        # Two workers at once: each response goes to one, and only to its region's.
        first, second = await asyncio.gather(
            rows.claim(db, "w1", None, now=now, lease_s=2, limit=5),
            rows.claim(db, "w2", None, now=now, lease_s=2, limit=5))
        assert [j.id for j in first + second] == ["resp_1"]
        holder = "w1" if first else "w2"
        assert [j.id for j in await rows.claim(db, "w3", "eu", now=now, lease_s=2, limit=5)
                ] == ["resp_2"]
        await rows.release(db, "resp_2", "w3")  # refused for now: not an attempt
        [back] = await rows.claim(db, "w3", "eu", now=now, lease_s=2, limit=5)
        assert back.attempts == 1
        assert await rows.append(db, "resp_1", holder, [_event(2, "in_progress")], now=now,
                                 lease_s=2)
        assert not await rows.append(db, "resp_1", "w9", [_event(3, "x")], now=now,
                                     lease_s=2)
        # Its lease past, another worker takes it over: the first one's writes are
        # refused, and the events after the queued two are dropped for the new attempt.
        later = now + timedelta(seconds=5)
        [again] = await rows.claim(db, "w4", None, now=later, lease_s=2, limit=5)
        assert again.attempts == 2
        assert not await rows.append(db, "resp_1", holder, [_event(2, "x")], now=later,
                                     lease_s=2)
        state, events = await here.events_after(w.a, "resp_1", -1)
        assert state == "running" and [e["type"] for e in events] == [
            "response.created", "response.queued"]
        done = {"id": "resp_1", "status": "completed"}
        assert await rows.finish(db, "resp_1", "w4", [_event(2, "completed")], now=later,
                                 response=done, stored=None)
        assert not await rows.finish(db, "resp_1", "w4", [], now=later, response=done,
                                     stored=None)
        state, events = await here.events_after(w.a, "resp_1", 1)
        assert state == "done" and [e["sequence_number"] for e in events] == [2]
        job = await here.get(w.a, "resp_1")
        assert job is not None and job.response == done
        assert not await here.cancel(w.a, job)  # it ended: nothing to cancel

        # Cancelled while running: the holder's next write is refused.
        await _queue(here, w, "resp_3")
        [held] = await rows.claim(db, "w5", None, now=later, lease_s=2, limit=5)
        assert await here.cancel(w.a, held)
        assert not await rows.append(db, "resp_3", "w5", [], now=later, lease_s=2)
        job = await here.get(w.a, "resp_3")
        assert job is not None and (job.state, job.response["status"]) == (
            "cancelled", "cancelled")
        assert not await here.delete(w.b, "resp_3")
        assert await here.delete(w.a, "resp_3")
        assert await here.events_after(w.a, "resp_3", -1) == (None, [])

    run(database_url, scenario)
