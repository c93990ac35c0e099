"""Rate limits shared by every gateway process through Redis (the scale-out `Limiter`).

The same token buckets as `limits.InProcessLimiter`, kept in Redis and changed only by two
Lua scripts, so every check-and-take is atomic across processes and costs one round trip:
`admit` checks and takes everything for all subjects or nothing; `settle` adjusts the token
buckets and removes the lease. Time is the Redis server's `TIME`, so every gateway process
agrees on it whatever its own clock says.

Keys, for prefix P (default "tokenyard:rl:"):
- `{P}<scope>:<id>:rpm`, `{P}<scope>:<id>:tpm`: a bucket, a hash {l: level, t: server time
  in seconds}. An absent key is a full bucket, so each key expires (PEXPIRE) when it would
  have refilled: idle subjects cost no memory.
- `{P}<scope>:<id>:leases`: the concurrency leases in flight, a sorted set of lease ids scored
  by their expiry (server ms). Expired leases are dropped before counting, so the slots of a
  crashed gateway free themselves after `lease_ttl` (10 minutes by default; a request running
  longer than that stops counting against the limit). Settle removes the lease.

Redis Cluster: every key of a deployment carries the same hash tag `{P}`, so a script's keys
always share one slot and the scripts run unchanged on a cluster — but all rate-limit keys of
one deployment then live on one shard. Give separate deployments separate prefixes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tokenyard.gateway.limits import (
    CONCURRENCY_RETRY_AFTER,
    EPSILON,
    Admission,
    Subject,
    check_amounts,
    rate_limit_state,
    rate_limited,
)

# Server time and the bucket helpers both scripts use.
_PRELUDE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

-- a bucket's level now: refilled at limit/60 per second up to limit; an absent key is full
local function level_at(key, limit)
  local stored = redis.call('HMGET', key, 'l', 't')
  if not stored[1] then return limit end
  local level = tonumber(stored[1]) + (now - tonumber(stored[2])) * limit / 60
  if level > limit then return limit end
  return level
end

-- a full bucket is an absent key, so the key expires when the bucket would be full again
local function store(key, level, limit)
  if level >= limit then
    redis.call('DEL', key)
    return
  end
  redis.call('HSET', key, 'l', string.format('%.17g', level), 't', string.format('%.6f', now))
  redis.call('PEXPIRE', key, math.ceil((limit - level) * 60000 / limit) + 1000)
end
"""

# KEYS per subject i: [3i-2] request bucket, [3i-1] token bucket, [3i] lease set.
# ARGV: [1] tokens, [2] lease id, [3] lease ttl (ms); per subject i: [3i+1] rpm, [3i+2] tpm,
# [3i+3] max concurrency ('' = unlimited); last ([3n+4]): requests to take (1, or 0 for a
# later attempt of a request already counted).
# Returns {refused subject (0: admitted), refused kind (1 requests, 2 tokens, 3 concurrency),
# retry seconds ('inf': never fits), then per subject: requests level, tokens level, leases in
# flight ('' = unlimited)} — after the take when admitted, before it when refused.
_ADMIT = _PRELUDE + f"""
local n = #KEYS / 3
local amounts = {{tonumber(ARGV[3 * n + 4]), tonumber(ARGV[1])}}
local levels = {{}}
local refused, refused_kind, retry = 0, 0, -1
for i = 1, n do
  for k = 1, 2 do
    local slot = 3 * i - 3 + k
    local limit = tonumber(ARGV[slot + 3])
    if limit then
      local level = level_at(KEYS[slot], limit)
      levels[slot] = level
      local amount = amounts[k]
      if level + {EPSILON!r} < amount then
        local wait = math.huge
        if amount <= limit then wait = (amount - level) * 60 / limit end
        if wait > retry then refused, refused_kind, retry = i, k, wait end
      end
    end
  end
  local slots = tonumber(ARGV[3 * i + 3])
  if slots then
    redis.call('ZREMRANGEBYSCORE', KEYS[3 * i], '-inf', now_ms)
    local in_flight = redis.call('ZCARD', KEYS[3 * i])
    levels[3 * i] = in_flight
    if in_flight >= slots and {CONCURRENCY_RETRY_AFTER!r} > retry then
      refused, refused_kind, retry = i, 3, {CONCURRENCY_RETRY_AFTER!r}
    end
  end
end
if refused == 0 then
  local expiry = now_ms + tonumber(ARGV[3])
  for i = 1, n do
    for k = 1, 2 do
      local slot = 3 * i - 3 + k
      if levels[slot] then
        levels[slot] = levels[slot] - amounts[k]
        store(KEYS[slot], levels[slot], tonumber(ARGV[slot + 3]))
      end
    end
    if levels[3 * i] then
      redis.call('ZADD', KEYS[3 * i], expiry, ARGV[2])
      -- the set outlives its longest lease (gateways may use different ttls)
      if redis.call('PTTL', KEYS[3 * i]) < tonumber(ARGV[3]) then
        redis.call('PEXPIRE', KEYS[3 * i], ARGV[3])
      end
      levels[3 * i] = levels[3 * i] + 1
    end
  end
end
local reply = {{tostring(refused), tostring(refused_kind), tostring(retry)}}
for slot = 1, 3 * n do
  reply[slot + 3] = levels[slot] and tostring(levels[slot]) or ''
end
return reply
"""

# KEYS per subject i: [2i-1] token bucket, [2i] lease set.
# ARGV: [1] tokens to give back (negative: to take), [2] lease id; per subject i: [2i+1] tpm
# ('' = unlimited), [2i+2] '1' when the admission holds a slot there.
_SETTLE = _PRELUDE + """
local refund = tonumber(ARGV[1])
for i = 1, #KEYS / 2 do
  local limit = tonumber(ARGV[2 * i + 1])
  if limit and refund ~= 0 then
    local level = level_at(KEYS[2 * i - 1], limit) + refund
    if level > limit then level = limit end
    store(KEYS[2 * i - 1], level, limit)
  end
  if ARGV[2 * i + 2] == '1' then redis.call('ZREM', KEYS[2 * i], ARGV[2]) end
end
return 0
"""


class RedisLimiter:
    """Token buckets and concurrency leases in Redis, shared by all gateway processes."""

    def __init__(self, url: str, prefix: str = "tokenyard:rl:", lease_ttl: float = 600.0) -> None:
        """`url`: redis://…; `prefix`: this deployment's keys (the hash tag); `lease_ttl`:
        seconds after which a concurrency slot that was never settled frees itself."""
        # One immediate retry on a new connection after a connection error: once Redis
        # restarts, every idle pooled connection is dead until used, and without it each
        # would fail one request with 503 long after Redis is back. The cost, only when a
        # reply is lost after the script ran: the request counted twice in its buckets
        # (its slot is one ZADD of the lease id, so not twice).
        self._redis = Redis.from_url(url, decode_responses=True, retry=Retry(NoBackoff(), 1))
        self.key_prefix = "{" + prefix + "}"
        self._lease_ttl_ms = max(1, round(lease_ttl * 1000))
        self._admit = self._redis.register_script(_ADMIT)
        self._settle = self._redis.register_script(_SETTLE)

    def _key(self, subject: Subject, name: str) -> str:
        return f"{self.key_prefix}{subject.scope}:{subject.id}:{name}"

    async def admit(self, subjects: Sequence[Subject], tokens: int,
                    requests: int = 1) -> Admission:
        """Take `requests`, `tokens` and one slot from every subject, or raise
        `RateLimited` and take nothing — one atomic script, one round trip."""
        check_amounts(tokens, requests)
        subjects = tuple(subjects)
        lease_id = os.urandom(8).hex()
        keys: list[str] = []
        args: list[str | int] = [tokens, lease_id, self._lease_ttl_ms]
        for subject in subjects:
            keys += (self._key(subject, "rpm"), self._key(subject, "tpm"),
                     self._key(subject, "leases"))
            limits = subject.limits
            args += (_arg(limits.rpm), _arg(limits.tpm), _arg(limits.max_concurrency))
        args.append(requests)
        reply = await self._admit(keys=keys, args=args)
        levels = [None if value == "" else float(value) for value in reply[3:]]
        refused = int(reply[0])
        if refused:
            raise rate_limited(subjects, tokens, levels, refused - 1, int(reply[1]) - 1,
                               float(reply[2]))
        return Admission(lease_id, subjects, tokens, rate_limit_state(subjects, levels))

    async def settle(self, admission: Admission, actual_tokens: int) -> None:
        """Give back reserved − actual tokens to each TPM bucket (take the difference when
        negative) and release the slots; a second settle of the same admission does nothing.
        Not retried: if Redis fails here, the slots free themselves after `lease_ttl` and the
        token buckets keep the whole reservation."""
        if admission.settled:
            return
        admission.settled = True  # before the await: a concurrent second settle sees it
        refund = admission.tokens - actual_tokens
        keys: list[str] = []
        args: list[str | int] = [refund, admission.lease_id]
        for subject in admission.subjects:
            limits = subject.limits
            adjusts = limits.tpm is not None and refund != 0
            holds_slot = limits.max_concurrency is not None
            if adjusts or holds_slot:
                keys += (self._key(subject, "tpm"), self._key(subject, "leases"))
                args += (_arg(limits.tpm if adjusts else None), "1" if holds_slot else "")
        if keys:
            await self._settle(keys=keys, args=args)

    async def close(self) -> None:
        await self._redis.aclose()


def _arg(limit: int | None) -> str | int:
    return "" if limit is None else limit
