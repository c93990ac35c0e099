"""The API-key cache in front of the store: TTL, shared misses, refresh ahead of expiry."""

from __future__ import annotations

import asyncio

from tokenyard.gateway.auth import Authenticator
from tokenyard.store.records import KeyContext, Limits, Scopes


def _key() -> KeyContext:
    return KeyContext(
        key_id="key_1", key_name="k", prefix="ty-abc", org_id="org_1", project_id=None,
        user_id=None, scopes=Scopes.from_json(None), key_limits=Limits(),
        org_limits=Limits(), expires_at=None, revoked_at=None, free_tier_daily_requests=None,
    )


class _Store:
    def __init__(self, found: KeyContext | None) -> None:
        self.found = found
        self.calls = 0

    async def find_key(self, secret: str) -> KeyContext | None:
        self.calls += 1
        await asyncio.sleep(0)
        return self.found


def test_hit_near_expiry_refreshes_in_background_without_waiting() -> None:
    async def run() -> None:
        now = [0.0]
        store = _Store(_key())
        auth = Authenticator(store.find_key, ttl_s=1.0, clock=lambda: now[0])
        assert await auth.lookup("s") is not None
        assert store.calls == 1
        now[0] = 0.4  # young entry: a plain hit
        await auth.lookup("s")
        assert store.calls == 1
        now[0] = 0.9  # second half of its life: served from the cache, queried behind
        assert await auth.lookup("s") is not None
        assert await auth.lookup("s") is not None  # one refresh at a time
        await asyncio.sleep(0.01)
        assert store.calls == 2
        now[0] = 1.5  # past the first expiry, but the refresh renewed the entry
        await auth.lookup("s")
        assert store.calls == 2

    asyncio.run(run())


def test_refresh_picks_up_a_revocation_within_the_ttl() -> None:
    async def run() -> None:
        now = [0.0]
        store = _Store(_key())
        auth = Authenticator(store.find_key, ttl_s=1.0, clock=lambda: now[0])
        await auth.lookup("s")
        store.found = None  # deleted in the store
        now[0] = 0.9
        assert await auth.lookup("s") is not None  # still within its TTL
        await asyncio.sleep(0.01)
        assert await auth.lookup("s") is None

    asyncio.run(run())


def test_unknown_key_is_not_refreshed_ahead() -> None:
    async def run() -> None:
        now = [0.0]
        store = _Store(None)
        auth = Authenticator(store.find_key, ttl_s=1.0, clock=lambda: now[0])
        assert await auth.lookup("bad") is None
        now[0] = 0.95
        assert await auth.lookup("bad") is None
        await asyncio.sleep(0.01)
        assert store.calls == 1  # a flood of bad keys: one query per key per TTL

    asyncio.run(run())



class _SlowStore(_Store):
    """Each call waits the next of `delays` (seconds) before it answers."""

    def __init__(self, found: KeyContext | None, delays: list[float]) -> None:
        super().__init__(found)
        self.delays = delays

    async def find_key(self, secret: str) -> KeyContext | None:
        self.calls += 1
        await asyncio.sleep(self.delays.pop(0) if self.delays else 0.0)
        return self.found


def test_an_expiry_before_the_refresh_task_runs_waits_on_that_refresh() -> None:
    """A busy loop: the refresh is scheduled, and the entry expires before its task runs.
    The next lookup must share that query. It used to start a second one on the same
    in-flight slot; the refresh, finishing first, emptied the slot, and the lookup then
    failed with a KeyError: a 503 'the key store is unavailable' to the client (seen in
    tests/integration/test_canary_shadow under load)."""
    async def run() -> None:
        now = [0.0]
        store = _SlowStore(_key(), [0.0, 0.05, 0.0])
        auth = Authenticator(store.find_key, ttl_s=1.0, clock=lambda: now[0])
        await auth.lookup("s")
        now[0] = 0.9
        assert await auth.lookup("s") is not None  # schedules the refresh; not run yet
        now[0] = 1.5  # expired before the refresh task got the loop
        assert await auth.lookup("s") is not None
        await asyncio.sleep(0.1)
        assert store.calls == 2  # the first lookup and the one refresh, nothing else
        assert not auth._inflight and not auth._refreshing

    asyncio.run(run())
