"""The accounts a request's money is held against, and the refusal that names one.

A request may be bounded by up to seven accounts: its org's prepaid balance, its org's
and its project's monthly spend caps, and the monthly and total budgets of its key and
of its user. Admission holds the request's maximum cost against every one of them, all
or nothing; settlement releases the hold and charges what it really cost. In one process
`Billing` and `Budgets` do that with figures of their own; with Redis, `RedisMoney`
(gateway/redis_money.py) does it for every gateway process at once, over the `Account`s
that `accounts_for` lists and the figures `seed_figures` reads from the store.

Whichever does it, a refusal is worded here (`refusal`): 429 insufficient_quota naming
the account, what it has left, what requests in flight hold of it and what this request
may cost at most.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tokenyard.errors import APIError, insufficient_quota
from tokenyard.store.ledger import LedgerWriter
from tokenyard.store.money import format_money
from tokenyard.store.records import CreditState, KeyContext
from tokenyard.store.repo import Store
from tokenyard.store.users import Subject

Kind = Literal["balance", "org_cap", "project_cap", "key_month", "key_total",
               "user_month", "user_total"]
#: What accounts start from in a shared store: `seed_figures` over a store and a ledger.
Seed = Callable[[Sequence["Account"]], Awaitable[list["int | CreditState"]]]
#: How long seeding waits for this process's ledger to commit what it settled.
FLUSH_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class Account:
    """One limit a request's money is held against: its `kind`, whose it is
    (`subject_id`: the org, project, key or user; `org_id`: the org it belongs to), the
    UTC month it counts ('YYYY-MM'; None: all time, or the balance), `cap` (micros; None
    for the balance, whose limit is its credit) and the micros `hold` to hold."""

    kind: Kind
    subject_id: str
    org_id: str
    month: str | None
    cap: int | None
    hold: int
    #: The balance's credit as the org's last read saw it (None for the others).
    credit: CreditState | None = None

    @property
    def name(self) -> str:
        """Its name in the shared store: kind, subject and month (or 'all')."""
        return f"{self.kind}:{self.subject_id}:{self.month or 'all'}"

    def in_month(self, month: str) -> Account:
        """The same account in `month` (itself if it is not monthly)."""
        if self.month is None or self.month == month:
            return self
        return Account(self.kind, self.subject_id, self.org_id, month, self.cap, self.hold)


def accounts_for(key: KeyContext, credit: CreditState | None,
                 caps: Mapping[str | None, int], month: str, micros: int,
                 budget_micros: int) -> list[Account]:
    """The accounts of a request by `key`, in the order refusals are checked: the org's
    balance (`credit`; None: postpaid), its spend caps (`caps`: project id, None for the
    org, to micros a month), then the budgets of its key and user. `micros` is held
    against the balance and caps, `budget_micros` (the dearest the request may cost, its
    prompt written to the prompt cache) against budgets."""
    out: list[Account] = []
    org = key.org_id
    if credit is not None:
        out.append(Account("balance", org, org, None, None, micros, credit))
    if (cap := caps.get(None)) is not None:
        out.append(Account("org_cap", org, org, month, cap, micros))
    if key.project_id is not None and (cap := caps.get(key.project_id)) is not None:
        out.append(Account("project_cap", key.project_id, org, month, cap, micros))
    for who, subject_id, budget in (("key", key.key_id, key.key_budget),
                                    ("user", key.user_id, key.user_budget)):
        if subject_id is None:
            continue
        if budget.monthly_micros is not None:
            out.append(Account(f"{who}_month", subject_id, org, month,  # type: ignore[arg-type]
                               budget.monthly_micros, budget_micros))
        if budget.total_micros is not None:
            out.append(Account(f"{who}_total", subject_id, org, None,  # type: ignore[arg-type]
                               budget.total_micros, budget_micros))
    return out


async def seed_figures(store: Store, ledger: LedgerWriter,
                       accounts: Sequence[Account]) -> list[int | CreditState]:
    """What each account starts from in a shared store that does not hold it yet, read
    from the database once this process's ledger has committed what it settled: the
    balance's `CreditState`, else the micros spent in its month (or in all)."""
    with contextlib.suppress(Exception):  # a database that is down fails the reads below
        await asyncio.wait_for(ledger.flush(), FLUSH_WAIT_S)
    spend: dict[tuple[Subject, str], tuple[int, int]] = {}
    out: list[int | CreditState] = []
    for account in accounts:
        if account.kind == "balance":
            out.append(await store.credit_state(account.org_id) or CreditState(0, 0, 0))
        elif account.kind == "org_cap":
            out.append(await store.month_spend(account.org_id))
        elif account.kind == "project_cap":
            out.append(await store.month_spend(account.org_id, account.subject_id))
        else:
            subject: Subject = "key" if account.kind.startswith("key") else "user"
            pair = (subject, account.subject_id)
            if pair not in spend:
                spend[pair] = await store.spend_of(subject, account.subject_id)
            out.append(spend[pair][0 if account.month is not None else 1])
    return out


class SharedHolds(Protocol):
    """Money held and settled for every gateway process at once (`RedisMoney`)."""

    async def reserve(self, accounts: Sequence[Account], seed: Seed) -> Any:
        """Hold each account's `hold`, all or nothing: the hold, or `refusal`'s error
        for the first account that cannot cover it. Accounts it does not hold yet start
        from `seed`'s figures (`seed_figures`)."""
        ...

    def settle(self, hold: Any, cost: int, month: str) -> None:
        """Release `hold` and charge `cost` micros to its accounts (monthly ones in
        `month`), in the background. Idempotent."""
        ...

    async def close(self) -> None:
        """Wait for the settlements under way, and let this process's holds go."""
        ...


def refusal(kind: Kind, subject_id: str, *, left: int, held: int, cost: int,
            cap: int | None = None) -> APIError | None:
    """The 429 for a request of maximum cost `cost` (micros) against an account with
    `left` micros (its cap, or its balance, less what was spent), `held` of it by
    requests in flight; None when it fits (something left, and enough beside the holds).
    """
    if left > 0 and left - held >= cost:
        return None
    if kind == "balance":
        if left <= 0:
            return quota(f"Your organization's prepaid balance is used up "
                          f"({format_money(left)} left). Add credit to continue.")
        return quota(
            f"Your organization's prepaid balance ({format_money(left)} left, "
            f"{format_money(held)} of it held by requests in flight) does not cover this "
            f"request's maximum cost of {format_money(cost)}. Retry once they finish, "
            "lower max_tokens, or add credit.")
    assert cap is not None
    spent = cap - left
    held_text = f", {format_money(held)} of it held by requests in flight" if held else ""
    if kind in ("org_cap", "project_cap"):
        whose = ("Your organization" if kind == "org_cap" else f"Project {subject_id}")
        if left <= 0:
            return quota(f"{whose} reached its monthly spend cap of {format_money(cap)} "
                          f"(spent {format_money(spent)}).")
        return quota(
            f"{whose}'s monthly spend cap of {format_money(cap)} (spent "
            f"{format_money(spent)}, {format_money(left)} left{held_text}) does not cover "
            f"this request's maximum cost of {format_money(cost)}. Lower max_tokens"
            + (", or retry once they finish." if held else "."))
    monthly = kind.endswith("_month")
    label = f"API key {subject_id}" if kind.startswith("key") else f"user {subject_id}"
    whose = f"The {'monthly' if monthly else 'total'} budget of {label} ({format_money(cap)} USD)"
    if left <= 0:
        when = " this month" if monthly else ""
        then = ("It renews with the next calendar month (UTC)." if monthly
                else "An admin may raise it.")
        return quota(f"{whose} is used up: {format_money(spent)} spent{when}. {then}")
    return quota(
        f"{whose} has {format_money(left)} left{held_text and held_text + ','} which does "
        f"not cover this request's maximum cost of {format_money(cost)}. Lower max_tokens"
        + (", or retry once they finish." if held else "."))


def quota(message: str) -> APIError:
    """429 insufficient_quota that says retrying does not help (x-should-retry)."""
    err = insufficient_quota(message)
    err.headers["x-should-retry"] = "false"
    return err
