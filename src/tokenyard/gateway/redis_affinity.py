"""The prefix-affinity table in Redis, shared by every gateway process and worker.

The same table as `balancer.affinity.LocalAffinity` (prefix block hash → the replica that
served it most recently; `AffinityTable`: `lookup(hashes)` gives, for each replica, how
many leading hashes it served last, and `record(hashes, replica)`), kept in Redis so that
a conversation that reaches another worker or another gateway host still goes to the
replica holding its prefix.

Keys, for prefix P (default "tokenyard:aff:"), all under the hash tag `{P}` (one cluster
slot, so the scripts run unchanged on a cluster):
- `{P}b:<hash>`: the replica id and its epoch, "<replica>|<epoch>", expiring `ttl` after
  the last record (10 minutes by default): the table is bounded by what was served within
  the ttl, and an idle prefix costs nothing after it.
- `{P}epochs`: a hash replica id → epoch. `forget(replica)` (a replica restarted with an
  empty cache, or left) bumps its epoch, which turns every entry recorded before it into
  a miss at once, without scanning for them. It expires with the last entry written under it.

Each `lookup` and each `record` is one Lua script, one round trip. Affinity only steers:
when Redis fails or is slow (`timeout`), `lookup` answers "no affinity" and `record`
drops the update, each with a warning, and the request goes on by least work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

logger = logging.getLogger("tokenyard.affinity")

#: Seconds an entry lives after it was last recorded.
DEFAULT_TTL_S = 600.0
#: Seconds a lookup or record may take before it is given up (the request goes on).
DEFAULT_TIMEOUT_S = 0.25
#: At most one warning per this many seconds while Redis fails.
_WARN_EVERY_S = 10.0

# KEYS: [1] the epochs hash, [2..] the leading block keys in prompt order.
# Returns the owners of the leading blocks, up to the first miss (or stale epoch).
_LOOKUP = """
local epochs = {}
local owners = {}
for i = 2, #KEYS do
  local value = redis.call('GET', KEYS[i])
  if not value then break end
  local replica, epoch = string.match(value, '^(.*)|(%d+)$')
  if not replica then break end
  local current = epochs[replica]
  if current == nil then
    current = redis.call('HGET', KEYS[1], replica) or '0'
    epochs[replica] = current
  end
  if current ~= epoch then break end
  owners[#owners + 1] = replica
end
return owners
"""

# KEYS: [1] the epochs hash, [2..] block keys. ARGV: [1] replica, [2] ttl (ms).
_RECORD = """
local epoch = redis.call('HGET', KEYS[1], ARGV[1]) or '0'
local value = ARGV[1] .. '|' .. epoch
for i = 2, #KEYS do
  redis.call('SET', KEYS[i], value, 'PX', ARGV[2])
end
if epoch ~= '0' and redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS: [1] the epochs hash. ARGV: [1] replica, [2] ttl (ms).
_FORGET = """
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class RedisAffinity:
    """`AffinityTable` over Redis: bounded by a ttl per entry, one round trip per call."""

    def __init__(self, url: str, prefix: str = "tokenyard:aff:", ttl: float = DEFAULT_TTL_S,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """`url`: redis://…; `prefix`: this deployment's keys (tests use their own);
        `ttl`: seconds an entry lives after its last record; `timeout`: seconds a call
        may take before it is given up."""
        self._redis = Redis.from_url(url, decode_responses=True, socket_timeout=timeout,
                                     socket_connect_timeout=timeout)
        self.key_prefix = "{" + prefix + "}"
        self._epochs = self.key_prefix + "epochs"
        self._ttl_ms = max(1, round(ttl * 1000))
        self._lookup = self._redis.register_script(_LOOKUP)
        self._record = self._redis.register_script(_RECORD)
        self._forget = self._redis.register_script(_FORGET)
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned = -_WARN_EVERY_S

    def block_key(self, block_hash: int) -> str:
        """The key of one block's entry."""
        return f"{self.key_prefix}b:{block_hash}"

    async def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each replica, how many leading `hashes` it served last (0s omitted): the
        entries are read from the first hash on, up to the first one nobody holds."""
        if not hashes:
            return {}
        try:
            owners = await self._lookup(
                keys=[self._epochs, *map(self.block_key, hashes)], args=[])
        except (RedisError, OSError) as exc:
            self._warn("lookup", exc)
            return {}
        depth: dict[str, int] = {}
        for i, replica in enumerate(owners):
            depth[replica] = i + 1
        return depth

    async def record(self, hashes: Sequence[int], replica: str) -> None:
        """`replica` now holds every prefix in `hashes`; each entry lives `ttl` from now."""
        if not hashes:
            return
        try:
            await self._record(keys=[self._epochs, *map(self.block_key, hashes)],
                               args=[replica, self._ttl_ms])
        except (RedisError, OSError) as exc:
            self._warn("record", exc)

    def forget(self, replica: str) -> None:
        """Drop what `replica` held (it restarted empty, or left the pool), for every
        gateway sharing the table: its epoch goes up, in the background (the balancer
        calls this from synchronous code)."""
        task = asyncio.get_running_loop().create_task(self.forget_now(replica))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def forget_now(self, replica: str) -> None:
        """`forget`, awaited."""
        try:
            await self._forget(keys=[self._epochs], args=[replica, self._ttl_ms])
        except (RedisError, OSError) as exc:
            self._warn("forget", exc)

    async def close(self) -> None:
        """Finish pending forgets and close the connections."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._redis.aclose()

    def _warn(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            logger.warning("affinity %s in Redis failed (routing goes on without it): %r",
                           what, exc)
