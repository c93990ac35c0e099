"""Money exact across the HTTP workers of one host without Redis (issue 40): the parent's
`MemoryMoney` holds every org balance, spend cap and budget of its workers, and each
worker's `SocketMoney` (the `SharedHolds` protocol) reaches it over the same Unix socket
as its limits (`gateway/limit_server.py`).

It keeps what `RedisMoney` keeps, in the parent's memory instead of Redis, under the same
rules: an account unknown to it (or idle past `idle_ttl` with nothing held) is seeded
from the database by the worker that needs it (`money_holds.seed_figures`); a hold is all
or nothing, checked against the running spend and every hold in flight; settling releases
the hold and charges the cost to the account of the month it ended in. A worker that goes
away (a crash, SIGKILL) loses its holds with its connection: they are released at once,
as a dead gateway's lapse in Redis. One event loop runs every call, so two workers' holds
can never both pass on the same money.

Calls, one JSON object per line on the limit server's connection (accounts as
`account_row`):

    → {"id": 3, "op": "money_reserve", "accounts": [row, …]}
    ← {"id": 3, "hold": "7"} | {"id": 3, "seed": [i, …]} | {"id": 3, "refused": [i, left, held]}
    → {"id": 4, "op": "money_seed", "accounts": [row, …], "figures": [micros | [b, c, seq], …]}
    → {"id": 5, "op": "money_settle", "hold": "7", "cost": 120, "month": "2026-11"}
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenyard.gateway.money_holds import Account, Seed, refusal
from tokenyard.store.records import CreditState

logger = logging.getLogger("tokenyard.gateway.money")


def account_row(account: Account) -> list[Any]:
    credit = account.credit
    return [account.kind, account.subject_id, account.org_id, account.month, account.cap,
            account.hold, None if credit is None else
            [credit.balance_micros, credit.credited_micros, credit.credit_seq]]


def row_account(row: Sequence[Any]) -> Account:
    kind, subject_id, org_id, month, cap, hold, credit = row
    return Account(kind, str(subject_id), str(org_id), None if month is None else str(month),
                   None if cap is None else int(cap), int(hold),
                   None if credit is None else CreditState(*map(int, credit)))


@dataclass(slots=True)
class _State:
    """One account as the parent knows it: its running spend (the ledger at its seed,
    plus every charge since), for the balance the credit figures, and the holds on it."""

    spent: int
    base: int = 0  # the balance at its seed
    c0: int = 0  # the credit then
    credit: int = 0  # the latest credit it knows, and its sequence number
    seq: int = 0
    holds: dict[str, int] = field(default_factory=dict)
    touched: float = 0.0

    def left(self, account: Account) -> int:
        if account.cap is not None:
            return account.cap - self.spent
        if account.credit is not None and account.credit.credit_seq > self.seq:
            self.credit, self.seq = account.credit.credited_micros, account.credit.credit_seq
        return self.base - self.c0 + self.credit - self.spent


class MemoryMoney:
    """The accounts of every worker of a host, in the parent's memory."""

    def __init__(self, idle_ttl: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_ttl = idle_ttl
        self._clock = clock
        self._accounts: dict[str, _State] = {}
        self._holds: dict[str, tuple[Account, ...]] = {}
        self._ids = itertools.count(1)

    def held(self) -> int:
        """Micros held now, over every account (0 once every request settled)."""
        return sum(sum(s.holds.values()) for s in self._accounts.values())

    def _known(self, name: str, now: float) -> _State | None:
        state = self._accounts.get(name)
        if state is not None and not state.holds and now - state.touched > self.idle_ttl:
            del self._accounts[name]  # idle: seeded again from the database
            return None
        return state

    def reserve(self, accounts: Sequence[Account], holds: set[str]) -> dict[str, Any]:
        """Hold each account's `hold`, all or nothing: `{"hold": id}` (added to `holds`,
        the connection's), `{"seed": [i…]}` or `{"refused": [i, left, held]}`."""
        now = self._clock()
        states = [self._known(a.name, now) for a in accounts]
        missing = [i for i, s in enumerate(states) if s is None]
        if missing:
            return {"seed": missing}
        for i, (account, state) in enumerate(zip(accounts, states, strict=True)):
            assert state is not None
            left, held = state.left(account), sum(state.holds.values())
            if left <= 0 or left - held < account.hold:
                return {"refused": [i, left, held]}
        hold_id = str(next(self._ids))
        for account, state in zip(accounts, states, strict=True):
            assert state is not None
            state.holds[hold_id] = account.hold
            state.touched = now
        self._holds[hold_id] = tuple(accounts)
        holds.add(hold_id)
        return {"hold": hold_id}

    def seed(self, accounts: Sequence[Account], figures: Sequence[Any]) -> None:
        """Start each account not known yet from its figure (micros spent, or the
        balance's [balance, credited, seq]); one known already is kept."""
        now = self._clock()
        for account, figure in zip(accounts, figures, strict=True):
            if self._known(account.name, now) is not None:
                continue
            if isinstance(figure, list):
                balance, credited, seq = map(int, figure)
                state = _State(0, balance, credited, credited, seq)
            else:
                state = _State(int(figure))
            state.touched = now
            self._accounts[account.name] = state

    def settle(self, hold_id: str, cost: int, month: str, holds: set[str]) -> None:
        """Release `hold_id` and charge `cost` to its accounts in `month`. Idempotent."""
        accounts = self._holds.pop(hold_id, None)
        holds.discard(hold_id)
        if accounts is None:
            return
        self._release(hold_id, accounts)
        now = self._clock()
        for account in accounts:
            state = self._accounts.get(account.in_month(month).name)
            if state is not None:  # else its seed will count it (from the ledger)
                state.spent += cost
                state.touched = now

    def drop(self, holds: set[str]) -> None:
        """A worker went away: release whatever its requests held."""
        for hold_id in list(holds):
            accounts = self._holds.pop(hold_id, None)
            if accounts is not None:
                self._release(hold_id, accounts)
        if holds:
            logger.warning("money: a worker left %d holds; released", len(holds))
        holds.clear()

    def _release(self, hold_id: str, accounts: Sequence[Account]) -> None:
        for account in accounts:
            state = self._accounts.get(account.name)
            if state is not None:
                state.holds.pop(hold_id, None)

    def answer(self, call: dict[str, Any], holds: set[str]) -> dict[str, Any]:
        """The reply to one `money_*` call of a connection whose holds are `holds`."""
        op = call["op"]
        if op == "money_reserve":
            return self.reserve([row_account(r) for r in call["accounts"]], holds)
        if op == "money_seed":
            self.seed([row_account(r) for r in call["accounts"]], list(call["figures"]))
            return {}
        if op == "money_settle":
            self.settle(str(call["hold"]), int(call["cost"]), str(call["month"]), holds)
            return {}
        raise ValueError(f"unknown op {op!r}")


class Caller(Protocol):
    """A connection to the parent's server (`limit_server.SocketLimiter.call`)."""

    async def call(self, call: dict[str, Any]) -> dict[str, Any]: ...


@dataclass(eq=False)
class SocketHold:
    """A request's hold in the parent's `MemoryMoney`."""

    id: str
    accounts: tuple[Account, ...]
    settled: bool = False


class SocketMoney:
    """One worker's `SharedHolds`: every hold and charge is the parent's."""

    def __init__(self, caller: Caller) -> None:
        self._caller = caller
        self._settling: set[asyncio.Task[None]] = set()

    async def reserve(self, accounts: Sequence[Account], seed: Seed) -> SocketHold:
        accounts = tuple(accounts)
        rows = [account_row(a) for a in accounts]
        for _ in range(4):
            reply = await self._caller.call({"op": "money_reserve", "accounts": rows})
            if "hold" in reply:
                return SocketHold(str(reply["hold"]), accounts)
            if "seed" in reply:
                wanted = [accounts[int(i)] for i in reply["seed"]]
                figures = await seed(wanted)
                await self._caller.call({
                    "op": "money_seed", "accounts": [account_row(a) for a in wanted],
                    "figures": [[f.balance_micros, f.credited_micros, f.credit_seq]
                                if isinstance(f, CreditState) else f for f in figures]})
                continue
            i, left, held = reply["refused"]
            account = accounts[int(i)]
            err = refusal(account.kind, account.subject_id, left=int(left), held=int(held),
                          cost=account.hold, cap=account.cap)
            assert err is not None
            raise err
        raise ConnectionError("the parent's money accounts went idle as fast as seeded")

    def settle(self, hold: SocketHold, cost: int, month: str) -> None:
        """Release `hold` and charge `cost` in the parent, in a task of its own. If the
        parent is gone, so are its holds: the cost is in this worker's ledger."""
        if hold.settled:
            return
        hold.settled = True
        task = asyncio.get_running_loop().create_task(self._settle(hold, cost, month))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, hold: SocketHold, cost: int, month: str) -> None:
        try:
            await self._caller.call({"op": "money_settle", "hold": hold.id, "cost": cost,
                                     "month": month})
        except ConnectionError as exc:
            logger.warning("settling a money hold in the parent failed: %r", exc)

    async def close(self) -> None:
        """Wait for the settlements under way (the connection is the limiter's)."""
        if self._settling:
            await asyncio.wait(set(self._settling), timeout=5.0)
