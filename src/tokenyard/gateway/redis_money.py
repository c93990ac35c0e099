"""Money held and settled in Redis for every gateway process at once (issue 40).

One Lua script holds a request's maximum cost against all its accounts
(`money_holds.Account`: the org's balance, spend caps, key and user budgets) or refuses
it and holds nothing; another releases the hold and charges the real cost. So N gateway
processes admit exactly what one would: the running spend and the holds in flight they
compare against are the same figures.

Keys, for prefix P (default "tokenyard:money:"), all under the hash tag `{P}`:
- `{P}owners`: a hash, gateway process (owner id) → the server time (ms) its holds lapse.
  Each process renews its own every `hold_ttl / 3`, or every second if that is sooner
  (the heartbeat); an entry past its time is a dead owner, and is dropped.
- `{P}<account name>`: a hash per account: `spent` (micros: what the ledger said at its
  seed, plus every charge since), for the balance `base` (the balance at the seed), `c0`
  (the credit then), `c` and `cs` (the latest credit and its sequence number, from
  `balances.credited_micros`/`credit_seq`), and `h:<owner>`: what each owner holds.
  An account without `spent` is not seeded: the reserving process reads its figures from
  the database and seeds it (keeping any holds already there). Each expires after
  `idle_ttl` untouched, and is seeded again from the database when next needed.

What an account has left: its cap (or, for the balance, `base - c0 + c`) less `spent`,
less the holds of live owners. Holds of an owner that is gone (a crashed gateway) are
dropped by the next reserve that reads the account, `hold_ttl` after its last heartbeat
at most. An owner that finds itself gone (its heartbeat lapsed, or Redis lost its keys)
takes a new id and holds again everything its requests in flight hold.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tokenyard.gateway.money_holds import Account, Seed, refusal
from tokenyard.store.records import CreditState

logger = logging.getLogger("tokenyard.gateway.money")
#: The longest time between two heartbeats: after Redis lost its keys, a process holds
#: its requests in flight again within it, so others admit against them for no longer.
BEAT_MAX_S = 1.0

_CLOCK = """
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local function num(x) return string.format('%.0f', x) end
"""

# KEYS: [1] owners, then the accounts. ARGV: [1] owner, [2] idle ttl (ms); per account i:
# [4i-1] cap ('' for the balance), [4i] credit, [4i+1] credit seq (the balance's, else ''),
# [4i+2] micros to hold.
# Returns {'ok'} | {'lost'} (the owner is gone) | {'seed', i...} (accounts not seeded)
# | {'refused', i, left, held} (the first account that cannot cover its hold).
_RESERVE = _CLOCK + """
local owner = ARGV[1]
local lapse = redis.call('HGET', KEYS[1], owner)
if not lapse or tonumber(lapse) < now_ms then return {'lost'} end
local n = #KEYS - 1
local missing = {'seed'}
local refused = nil
for i = 1, n do
  local key = KEYS[i + 1]
  local fields = redis.call('HGETALL', key)
  local f = {}
  local held = 0
  for j = 1, #fields, 2 do
    local name = fields[j]
    if string.sub(name, 1, 2) == 'h:' then
      local until_ms = redis.call('HGET', KEYS[1], string.sub(name, 3))
      if until_ms and tonumber(until_ms) >= now_ms then
        held = held + tonumber(fields[j + 1])
      else
        redis.call('HDEL', key, name)  -- a dead owner's hold
      end
    else
      f[name] = fields[j + 1]
    end
  end
  if not f['spent'] then
    missing[#missing + 1] = tostring(i)
  elseif not refused then
    local a = 4 * i - 1
    local limit
    if ARGV[a] == '' then
      local seq = tonumber(ARGV[a + 2])
      if seq > tonumber(f['cs']) then  -- a later credit than the account knew
        redis.call('HSET', key, 'c', ARGV[a + 1], 'cs', ARGV[a + 2])
        f['c'] = ARGV[a + 1]
      end
      limit = tonumber(f['base']) - tonumber(f['c0']) + tonumber(f['c'])
    else
      limit = tonumber(ARGV[a])
    end
    local left = limit - tonumber(f['spent'])
    if left <= 0 or left - held < tonumber(ARGV[a + 3]) then
      refused = {'refused', tostring(i), num(left), num(held)}
    end
  end
end
if #missing > 1 then return missing end
if refused then return refused end
for i = 1, n do
  redis.call('HINCRBY', KEYS[i + 1], 'h:' .. owner, ARGV[4 * i + 2])
  redis.call('PEXPIRE', KEYS[i + 1], ARGV[2])
end
return {'ok'}
"""

# KEYS: n accounts to release, then n to charge (the same, or the month of the charge).
# ARGV: [1] owner, [2] idle ttl (ms), [3] cost (micros); [3+i] the hold on account i.
_SETTLE = """
local n = #KEYS / 2
local field = 'h:' .. ARGV[1]
for i = 1, n do
  local key = KEYS[i]
  if redis.call('HEXISTS', key, field) == 1 then  -- else its owner was dropped
    if redis.call('HINCRBY', key, field, -tonumber(ARGV[3 + i])) <= 0 then
      redis.call('HDEL', key, field)
    end
  end
  local charge = KEYS[n + i]
  if redis.call('HEXISTS', charge, 'spent') == 1 then  -- else its seed will count it
    redis.call('HINCRBY', charge, 'spent', ARGV[3])
    redis.call('PEXPIRE', charge, ARGV[2])
  end
end
return 0
"""

# KEYS: accounts. ARGV: [1] idle ttl (ms); per account i: [2i] spent, [2i+1] for the
# balance its 'base c seq' ('' for the others). An account already seeded is kept.
_SEED = """
for i = 1, #KEYS do
  local key = KEYS[i]
  if redis.call('HEXISTS', key, 'spent') == 0 then
    local credit = ARGV[2 * i + 1]
    if credit ~= '' then
      local base, c, cs = string.match(credit, '(%S+) (%S+) (%S+)')
      redis.call('HSET', key, 'base', base, 'c0', c, 'c', c, 'cs', cs)
    end
    redis.call('HSET', key, 'spent', ARGV[2 * i])
  end
  redis.call('PEXPIRE', key, ARGV[1])
end
return 0
"""

# KEYS: [1] owners. ARGV: [1] owner, [2] hold ttl (ms), [3] '1': register it anew.
# Returns 1 if the owner lives (renewed, or registered), 0 if it is gone. Drops the entries
# of owners past their time.
_BEAT = _CLOCK + """
local lapse = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[3] ~= '1' and (not lapse or tonumber(lapse) < now_ms) then return 0 end
local all = redis.call('HGETALL', KEYS[1])
for j = 1, #all, 2 do
  if tonumber(all[j + 1]) < now_ms then redis.call('HDEL', KEYS[1], all[j]) end
end
redis.call('HSET', KEYS[1], ARGV[1], num(now_ms + tonumber(ARGV[2])))
return 1
"""

# KEYS: accounts. ARGV: [1] owner, [2] idle ttl (ms); [2+i] micros to hold on account i,
# whatever is left (what requests already running hold, once more under a new owner).
_REHOLD = """
for i = 1, #KEYS do
  redis.call('HINCRBY', KEYS[i], 'h:' .. ARGV[1], ARGV[2 + i])
  redis.call('PEXPIRE', KEYS[i], ARGV[2])
end
return 0
"""


@dataclass(eq=False)
class RedisHold:
    """A request's hold on its accounts in Redis, under the owner that holds it."""

    owner: str
    accounts: tuple[Account, ...]
    settled: bool = False


class RedisMoney:
    """Holds and spend in Redis, shared by every gateway process (`SharedHolds`)."""

    def __init__(self, url: str, prefix: str = "tokenyard:money:", hold_ttl: float = 30.0,
                 idle_ttl: float = 3600.0) -> None:
        """`hold_ttl`: seconds after its last heartbeat that a process's holds lapse (a
        crashed gateway's); `idle_ttl`: an account untouched this long is dropped (and
        seeded again from the database when next needed)."""
        # One immediate retry on a fresh connection, as RedisLimiter: a restarted Redis
        # leaves every pooled connection dead until used.
        self._redis = Redis.from_url(url, decode_responses=True, retry=Retry(NoBackoff(), 1))
        self.key_prefix = "{" + prefix + "}"
        self._owners = self.key_prefix + "owners"
        self.hold_ttl = hold_ttl
        self._hold_ttl_ms = max(1, round(hold_ttl * 1000))
        self._idle_ms = max(1, round(idle_ttl * 1000))
        self._reserve = self._redis.register_script(_RESERVE)
        self._settle = self._redis.register_script(_SETTLE)
        self._seed = self._redis.register_script(_SEED)
        self._beat = self._redis.register_script(_BEAT)
        self._rehold = self._redis.register_script(_REHOLD)
        self.owner = ""  # registered on first use
        self._live: set[RedisHold] = set()
        self._rotating: asyncio.Lock | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._settling: set[asyncio.Task[None]] = set()
        self._seeding: dict[str, asyncio.Task[None]] = {}

    def key(self, account: Account) -> str:
        return self.key_prefix + account.name

    async def reserve(self, accounts: Sequence[Account], seed: Seed) -> RedisHold:
        """Hold each account's `hold`, all or nothing; 429 (`money_holds.refusal`) naming
        the first that cannot cover it. Accounts Redis does not hold yet are seeded with
        `seed`'s figures first (and once more if Redis lost them meanwhile)."""
        accounts = tuple(accounts)
        keys = [self._owners, *map(self.key, accounts)]
        args: list[str | int] = ["", self._idle_ms]
        for account in accounts:
            credit = account.credit
            args += (("", credit.credited_micros, credit.credit_seq) if credit is not None
                     else (account.cap if account.cap is not None else 0, "", "")) \
                + (account.hold,)
        for _ in range(4):
            if not self.owner:
                await self._rotate("")
            owner = args[0] = self.owner
            reply = await self._reserve(keys=keys, args=args)
            if reply[0] == "ok":
                hold = RedisHold(str(owner), accounts)
                self._live.add(hold)
                if hold.owner != self.owner:  # the owner changed while the script ran
                    await self._hold_again([hold])
                return hold
            if reply[0] == "lost":
                await self._rotate(str(owner))
            elif reply[0] == "seed":
                await self._seed_missing([accounts[int(i) - 1] for i in reply[1:]], seed)
            else:
                account = accounts[int(reply[1]) - 1]
                err = refusal(account.kind, account.subject_id, left=int(reply[2]),
                              held=int(reply[3]), cost=account.hold, cap=account.cap)
                assert err is not None
                raise err
        raise ConnectionError("Redis lost the money accounts as fast as they were seeded")

    def settle(self, hold: RedisHold, cost: int, month: str) -> None:
        """Release `hold` and charge `cost` micros to its accounts (monthly ones in
        `month`), in a task of its own, retried while Redis is unreachable. Idempotent."""
        if hold.settled:
            return
        hold.settled = True
        self._live.discard(hold)
        task = asyncio.get_running_loop().create_task(self._settle_until_done(hold, cost,
                                                                              month))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle_until_done(self, hold: RedisHold, cost: int, month: str) -> None:
        keys = [*map(self.key, hold.accounts),
                *(self.key(account.in_month(month)) for account in hold.accounts)]
        args: list[str | int] = [hold.owner, self._idle_ms, cost,
                                 *(a.hold for a in hold.accounts)]
        delay = 0.05
        while True:
            try:
                await self._settle(keys=keys, args=args)
                return
            except Exception as exc:
                logger.warning("settling a money hold failed (%r); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _seed_missing(self, accounts: Sequence[Account], seed: Seed) -> None:
        """Seed `accounts`: one read of the database for those no request of this process
        is seeding already (at an org's first sight, its requests wait for one read)."""
        keys = [self.key(account) for account in accounts]
        new = [account for account, key in zip(accounts, keys, strict=True)
               if key not in self._seeding]
        if new:
            task = asyncio.get_running_loop().create_task(self._seed_now(new, seed))
            for account in new:
                self._seeding[self.key(account)] = task

            def forget(done: asyncio.Task[None]) -> None:
                for key in keys:
                    if self._seeding.get(key) is done:
                        del self._seeding[key]

            task.add_done_callback(forget)
        tasks = {self._seeding[key] for key in keys if key in self._seeding}
        await asyncio.shield(asyncio.gather(*tasks))

    async def _seed_now(self, accounts: Sequence[Account], seed: Seed) -> None:
        figures = await seed(accounts)
        args: list[str | int] = [self._idle_ms]
        for figure in figures:
            if isinstance(figure, CreditState):
                args += (0, f"{figure.balance_micros} {figure.credited_micros} "
                            f"{figure.credit_seq}")
            else:
                args += (figure, "")
        await self._seed(keys=[*map(self.key, accounts)], args=args)

    async def _rotate(self, lost: str) -> None:
        """Take a new owner id (none yet, or `lost` is gone) and hold again, under it,
        what this process's requests in flight hold."""
        if self._rotating is None:
            self._rotating = asyncio.Lock()
        async with self._rotating:
            if self.owner != lost:
                return  # another request rotated it already
            owner = os.urandom(8).hex()
            await self._beat(keys=[self._owners], args=[owner, self._hold_ttl_ms, "1"])
            self.owner = owner
            if lost:
                logger.warning("this gateway's money holds lapsed in Redis (owner %s): "
                               "holding its %d requests in flight again as %s", lost,
                               len(self._live), owner)
            await self._hold_again(list(self._live))
        if self._heartbeat is None:
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat_forever())

    async def _hold_again(self, holds: Sequence[RedisHold]) -> None:
        owner = self.owner
        keys: list[str] = []
        args: list[str | int] = [owner, self._idle_ms]
        for hold in holds:
            hold.owner = owner
            keys += map(self.key, hold.accounts)
            args += (account.hold for account in hold.accounts)
        if keys:
            await self._rehold(keys=keys, args=args)

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(min(self.hold_ttl / 3, BEAT_MAX_S))
            owner = self.owner
            try:
                if not await self._beat(keys=[self._owners], args=[owner, self._hold_ttl_ms,
                                                                   ""]):
                    await self._rotate(owner)
            except Exception as exc:  # Redis is down: the next beat tries again
                logger.warning("the money heartbeat failed: %r", exc)

    async def close(self) -> None:
        """Wait for the settlements under way (retried at most once more), stop the
        heartbeat and drop this process's owner entry (its holds lapse at once)."""
        if self._settling:
            await asyncio.wait(set(self._settling), timeout=5.0)
        if self._settling:
            logger.error("%d money settlements could not reach Redis before shutdown: "
                         "their costs are in the ledger, not in Redis's running spend",
                         len(self._settling))
            for task in list(self._settling):
                task.cancel()
            await asyncio.gather(*self._settling, return_exceptions=True)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        if self.owner:
            try:
                await self._redis.hdel(self._owners, self.owner)
            except Exception as exc:
                logger.warning("dropping the money owner entry failed: %r", exc)
        await self._redis.aclose()
