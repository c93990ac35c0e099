"""Stages 3 and 4: who is calling (API key → org, project) and what that key may do.

Keys are looked up by the SHA-256 of the secret (the store never holds secrets). A lookup
is cached for at most `ttl_s` (1 s by default), unknown keys included, so a revocation
takes effect within a second and a flood of bad keys costs one query per key per second.
Concurrent misses for one key share a single query. A known key in use is looked up again
in the background during the second half of its entry's life, so requests keep hitting the
cache instead of all waiting on the query (slow when the event loop is busy) each second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime

from tokenyard.errors import APIError, authentication_failed
from tokenyard.store.records import KeyContext

logger = logging.getLogger("tokenyard.gateway")

#: The part of a cached entry's life, at its end, in which a hit refreshes it ahead.
REFRESH_AHEAD = 0.5

#: How the key arrives: OpenAI's bearer token, or Anthropic's header.
AUTHORIZATION = "authorization"
X_API_KEY = "x-api-key"


def credential(headers: Mapping[str, str]) -> str | None:
    """The secret from ``Authorization: Bearer …`` or ``x-api-key`` (None: neither)."""
    auth = headers.get(AUTHORIZATION) or headers.get("Authorization")
    if auth:
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = headers.get(X_API_KEY) or headers.get("X-Api-Key")
    return key.strip() if key and key.strip() else None


class Authenticator:
    """Secrets → `KeyContext`, through a small TTL cache in front of `find_key`."""

    def __init__(
        self,
        find_key: Callable[[str], Awaitable[KeyContext | None]],
        *,
        ttl_s: float = 1.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._find_key = find_key
        self._ttl = ttl_s
        self._max = max_entries
        self._clock = clock
        self._now = now
        self._cache: OrderedDict[str, tuple[float, KeyContext | None]] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[KeyContext | None]] = {}
        self._refreshing: dict[str, asyncio.Task[KeyContext | None]] = {}

    async def lookup(self, secret: str) -> KeyContext | None:
        """The key's context (revoked and expired keys included), at most `ttl_s` old."""
        hit = self._cache.get(secret)
        if hit is not None:
            expires, found = hit
            left = expires - self._clock()
            if left > 0:
                if (found is not None and left < self._ttl * REFRESH_AHEAD
                        and secret not in self._refreshing and secret not in self._inflight):
                    self._refresh(secret)
                return found
        pending = self._inflight.get(secret)
        if pending is not None:
            return await asyncio.shield(pending)
        return await self._query(secret)

    def _refresh(self, secret: str) -> None:
        """Query `secret` again in a task of its own; a failure is logged and the entry
        simply expires (the next request then queries in the foreground). The query is
        in flight from this call on, not from when the task first runs: a lookup that
        finds the entry expired before then (a busy loop) waits on it instead of starting
        a second query that would share, and then drop, the same in-flight slot."""
        task = asyncio.get_running_loop().create_task(self._fill(secret, self._claim(secret)))
        self._refreshing[secret] = task

        def done(task: asyncio.Task[KeyContext | None]) -> None:
            self._refreshing.pop(secret, None)
            if not task.cancelled() and task.exception() is not None:
                logger.warning("refreshing an API key failed: %r", task.exception())

        task.add_done_callback(done)

    async def _query(self, secret: str) -> KeyContext | None:
        """`find_key(secret)`, shared by concurrent callers, and cached."""
        return await self._fill(secret, self._claim(secret))

    def _claim(self, secret: str) -> asyncio.Future[KeyContext | None]:
        """The in-flight slot of a query of `secret` about to start."""
        future: asyncio.Future[KeyContext | None] = asyncio.get_running_loop().create_future()
        self._inflight[secret] = future
        return future

    async def _fill(self, secret: str, future: asyncio.Future[KeyContext | None],
                    ) -> KeyContext | None:
        try:
            found = await self._find_key(secret)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning when no one waits
            raise
        finally:
            if self._inflight.get(secret) is future:
                del self._inflight[secret]
        future.set_result(found)
        self._cache[secret] = (self._clock() + self._ttl, found)
        self._cache.move_to_end(secret)
        while len(self._cache) > self._max:
            self._cache.popitem(last=False)
        return found

    async def authenticate(self, headers: Mapping[str, str]) -> KeyContext:
        """The calling key, or a 401 that says what is wrong with it."""
        secret = credential(headers)
        if secret is None:
            raise authentication_failed(
                "You didn't provide an API key. Pass it as 'Authorization: Bearer <key>' "
                "or in the 'x-api-key' header."
            )
        key = await self.lookup(secret)
        if key is None:
            raise authentication_failed(f"Incorrect API key provided: {_masked(secret)}.")
        if key.revoked_at is not None:
            raise authentication_failed(f"The API key {key.prefix}… has been revoked.")
        if not key.is_active(self._now()):
            raise authentication_failed(f"The API key {key.prefix}… has expired.")
        return key


def _masked(secret: str) -> str:
    return secret[:6] + "*" * 4 + secret[-4:] if len(secret) > 12 else "*" * len(secret)


def authorize(key: KeyContext, model: str, context_tokens: int,
              alias: str | None = None) -> None:
    """Stage 4: the key's scopes allow `model` (or the `alias` the client named for it)
    and `context_tokens` (prompt + max_tokens)."""
    scopes = key.scopes
    if not scopes.allows_model(model) and not (alias and scopes.allows_model(alias)):
        raise APIError(
            403, f"The API key {key.prefix}… may not use model '{model}' (scope 'models' "
            f"allows {', '.join(scopes.models)}).", code="model_not_in_scope")
    cap = scopes.max_context_tokens
    if cap is not None and context_tokens > cap:
        raise APIError(
            403, f"The API key {key.prefix}… may use at most {cap} context tokens (scope "
            f"'max_context_tokens'); this request needs {context_tokens} (prompt + "
            "max_tokens).", code="context_over_scope")


def require_admin(key: KeyContext) -> None:
    """403 unless the key has the admin scope."""
    if not key.scopes.admin:
        raise APIError(403, f"The API key {key.prefix}… lacks the 'admin' scope.",
                       code="missing_scope")
