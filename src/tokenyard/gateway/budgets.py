"""Stage 6 for keys and users: their spend budgets, checked at admission.

A key, and the user it belongs to, may each have a budget (`Budget`): a cap per UTC
calendar month and a cap on all their spend. Admission (`Budgets.reserve`, called by
`Billing.reserve`) holds the request's maximum cost against each budget of its key and
user until it is metered (`release`), as the org's prepaid balance is held; a request is
refused (429 insufficient_quota, naming the budget) when what a budget has left, less what
the requests in flight hold, does not cover its maximum cost. So requests at once never
spend past a budget: the most a request can cost is held before it runs.

Nothing here reads the database per request. Each key or user with a budget has a spend
view: its month's and all-time spend as last read from the ledger (one indexed query,
in the background once older than `refresh_s`; awaited only on first sight and when the
month changed), plus what this process settled since that read began (`settled`, O(1)).
Keys and users without a budget cost nothing. Holds and local spend live in this process,
like the org's: several gateway processes see each other's spend within `refresh_s` of
its ledger rows landing, and each holds only its own requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tokenyard.gateway.money_holds import refusal
from tokenyard.store.ledger import LedgerWriter
from tokenyard.store.money import format_money
from tokenyard.store.records import Budget, KeyContext
from tokenyard.store.repo import Store
from tokenyard.store.users import Subject

logger = logging.getLogger("tokenyard.gateway.budgets")
#: How long a refresh waits for the ledger to commit what this process settled.
FLUSH_WAIT_S = 2.0


def month_of(now: datetime) -> str:
    """'YYYY-MM': the UTC calendar month a monthly budget counts."""
    return f"{now.year:04d}-{now.month:02d}"


@dataclass(eq=False)
class _SpendView:
    """A key's or a user's spend as last read from the ledger, plus local changes since."""

    subject: Subject
    subject_id: str
    org_id: str
    budget: Budget
    month: str = ""  # the month `month_spent` is of ("": never read)
    month_spent: int = 0  # micros
    total_spent: int = 0
    held: int = 0  # the maximum cost of this process's admitted, unmetered requests
    read_at: float = float("-inf")
    # Settled here since the read began: (sequence, month, cost), and their sums (the
    # month's only those of `month`). Dropped once a read that started after them lands.
    local: deque[tuple[int, str, int]] = field(default_factory=deque)
    local_month: int = 0
    local_total: int = 0
    refreshing: asyncio.Task[None] | None = None

    def check(self, micros: int) -> None:
        """Refuse a request of maximum cost `micros` that this view's budget cannot cover."""
        for period, cap, spent in (("month", self.budget.monthly_micros,
                                    self.month_spent + self.local_month),
                                   ("total", self.budget.total_micros,
                                    self.total_spent + self.local_total)):
            if cap is not None and (err := refusal(
                    f"{self.subject}_{period}", self.subject_id,  # type: ignore[arg-type]
                    left=cap - spent, held=self.held, cost=micros, cap=cap)):
                raise err

    def to_json(self) -> dict[str, Any]:
        def money(micros: int | None) -> str | None:
            return None if micros is None else format_money(micros)

        return {"subject": self.subject, "id": self.subject_id, "org_id": self.org_id,
                "monthly_budget": money(self.budget.monthly_micros),
                "month_spent": money(self.month_spent + self.local_month),
                "total_budget": money(self.budget.total_micros),
                "total_spent": money(self.total_spent + self.local_total),
                "held": money(self.held)}


@dataclass(eq=False)
class BudgetHold:
    """A request's maximum cost, held against the budgets of its key and its user from
    admission (`Budgets.reserve`) until `Budgets.release`."""

    views: tuple[_SpendView, ...]
    micros: int
    released: bool = False


class Budgets:
    """The spend views of keys and users with a budget, over a `Store` and the ledger."""

    def __init__(self, store: Store, ledger: LedgerWriter, *, refresh_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.ledger = ledger
        self.refresh_s = refresh_s
        self._clock = clock
        self._views: dict[tuple[Subject, str], _SpendView] = {}
        self._seq = 0

    async def reserve(self, key: KeyContext, micros: int) -> BudgetHold | None:
        """Hold `micros` against the budgets of `key` and of its user; 429
        insufficient_quota naming the budget that cannot cover it. None: no budget."""
        views = []
        for subject, subject_id, budget in self._subjects(key):
            if budget:
                views.append(await self._view(subject, subject_id, key.org_id, budget))
            else:
                self._views.pop((subject, subject_id), None)  # its budget was removed
        if not views:
            return None
        # Checked and held with no await between: requests at once see each other's holds.
        for view in views:
            view.check(micros)
        for view in views:
            view.held += micros
        return BudgetHold(tuple(views), micros)

    def release(self, hold: BudgetHold | None) -> None:
        """Give a hold back (its request was metered, or never ran). Idempotent."""
        if hold is None or hold.released:
            return
        hold.released = True
        for view in hold.views:
            view.held -= hold.micros

    def settled(self, key: KeyContext, micros: int) -> None:
        """Count a metered request's cost in its key's and user's views (if any)."""
        if not self._views:
            return
        month = month_of(self.store.clock())
        for subject, subject_id, _ in self._subjects(key):
            view = self._views.get((subject, subject_id))
            if view is None:
                continue
            self._seq += 1
            view.local.append((self._seq, month, micros))
            view.local_total += micros
            if month == view.month:
                view.local_month += micros

    def to_json(self) -> list[dict[str, Any]]:
        """Each budget this process has checked, with its spend and holds (the dashboard)."""
        return [view.to_json() for _, view in sorted(self._views.items())]

    @staticmethod
    def _subjects(key: KeyContext) -> list[tuple[Subject, str, Budget]]:
        out: list[tuple[Subject, str, Budget]] = [("key", key.key_id, key.key_budget)]
        if key.user_id is not None:
            out.append(("user", key.user_id, key.user_budget))
        return out

    async def _view(self, subject: Subject, subject_id: str, org_id: str,
                    budget: Budget) -> _SpendView:
        view = self._views.get((subject, subject_id))
        if view is None:
            view = self._views[(subject, subject_id)] = _SpendView(subject, subject_id,
                                                                   org_id, budget)
        view.budget = budget  # the key's context is at most the key cache's TTL old
        stale = view.month != month_of(self.store.clock())
        if (stale or self._clock() - view.read_at > self.refresh_s) and view.refreshing is None:
            view.refreshing = asyncio.create_task(self._refresh(view))
        if stale and view.refreshing is not None:
            # Never read, or a new month began: the one time requests wait for a read.
            await asyncio.shield(view.refreshing)
        return view

    async def _refresh(self, view: _SpendView) -> None:
        started_seq = self._seq
        month = month_of(self.store.clock())
        try:
            # What was settled before this read began must be in the database when it
            # reads; bounded, so a database that is down cannot hold a request.
            await asyncio.wait_for(self.ledger.flush(), FLUSH_WAIT_S)
            month_spent, total_spent = await self.store.spend_of(view.subject,
                                                                 view.subject_id)
        except Exception:
            logger.exception("budget refresh for %s %s failed; keeping the last figures",
                             view.subject, view.subject_id)
            return
        finally:
            view.refreshing = None
        while view.local and view.local[0][0] <= started_seq:
            view.local.popleft()
        view.month, view.month_spent, view.total_spent = month, month_spent, total_spent
        view.local_total = sum(cost for _, _, cost in view.local)
        view.local_month = sum(cost for _, m, cost in view.local if m == month)
        view.read_at = self._clock()


