"""A running Idempotency-Key claim names its process: a retry after that process died (a
gateway worker SIGKILLed mid-request) runs at once, where it used to get 409 for the
claim's whole 15-minute lease; a live owner, or one on another host, still gets 409."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

from tokenyard.gateway.idempotency import claim_owner, owner_is_dead
from tokenyard.store import Database, Store


def _dead_owner() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return f"{socket.gethostname()}:{proc.pid}:1"


def test_owner_liveness() -> None:
    assert not owner_is_dead(claim_owner())
    assert owner_is_dead(_dead_owner())
    assert not owner_is_dead("another-host:1:1")  # not ours to judge


def test_a_dead_owner_s_running_claim_is_taken_over(tmp_path: Path) -> None:
    async def scenario() -> list[str]:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'i.db'}")
        store = Store(db)
        outcomes = []
        try:
            for key, first_owner in (("dead", _dead_owner()), ("live", claim_owner()),
                                     ("remote", "another-host:1:1")):
                await store.idem_begin("org_a", key, "h", owner=first_owner)
                outcome, _ = await store.idem_begin("org_a", key, "h", owner=claim_owner(),
                                                    owner_is_dead=owner_is_dead)
                outcomes.append(outcome)
            # The new claim is a claim like any other: the next retry waits for it.
            outcomes.append((await store.idem_begin("org_a", "dead", "h",
                                                    owner=claim_owner(),
                                                    owner_is_dead=owner_is_dead))[0])
        finally:
            await db.close()
        return outcomes

    assert asyncio.run(scenario()) == ["new", "running", "running", "running"]
