"""Stage 6 (the billing pre-check) and stage 19 (metering): may this org spend now, and
what did the request cost.

The pre-check never waits on the database once an org is known: it reads a per-org
snapshot (prepaid balance, this month's spend by org and by project, today's requests)
that is refreshed in the background when older than `refresh_s`, and adds what this
process settled since the snapshot was read. Metering appends one row to the ledger
writer (off the request path, journaled) and records the same cost locally, so the next
pre-check sees it before the row reaches the database.

Against a prepaid balance, admission (`reserve`) also holds the request's maximum cost
(every prompt token at the input price, every token its completions may generate at the
output price) until it is metered (`release`), so requests in flight see each other: a
request is refused when the balance left, less what is held, does not cover its maximum
cost, even when nothing is held: one process never overdraws a balance (issue 40).

Those holds live in this process, like the local spend. With a `SharedHolds` (Redis:
gateway/redis_money.py) every gateway process holds and settles the money of the
balance, the spend caps and the key and user budgets there instead, against the same
running spend, so N processes never spend past any of them (docs/operations.md, "Money
across gateways"); the snapshot then only says which accounts a request has (the balance's
credit, the caps) and the free tier's count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tokenyard.deployments import PriceSpec
from tokenyard.errors import APIError
from tokenyard.gateway.budgets import BudgetHold, Budgets, month_of
from tokenyard.gateway.money_holds import (
    SharedHolds,
    accounts_for,
    quota,
    refusal,
    seed_figures,
)
from tokenyard.store.ledger import LedgerWriter, UsageRecord
from tokenyard.store.money import (
    Prices,
    cost_micros,
    cost_quarters,
    format_exact,
    format_money,
)
from tokenyard.store.records import CreditState, KeyContext
from tokenyard.store.repo import Store

logger = logging.getLogger("tokenyard.gateway.billing")
#: The currency of every price and balance (prices are set in it; nothing converts).
CURRENCY = "USD"
#: How long a refresh waits for the ledger to commit what this process settled.
FLUSH_WAIT_S = 2.0


@dataclass(frozen=True)
class Usage:
    """What one request used, as its response reports it."""

    prompt_tokens: int  # every prompt token, cached and written ones included
    cached_tokens: int
    output_tokens: int
    cache_write_5m_tokens: int = 0  # prompt tokens written to the prompt cache for 5 min
    cache_write_1h_tokens: int = 0  # ... and for 1 h

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(eq=False)
class Hold:
    """A request's maximum cost, held against its org's prepaid balance from admission
    (`Billing.reserve`) until `Billing.release`."""

    org_id: str
    micros: int
    released: bool = False
    #: The hold on the budgets of the request's key and user (`gateway/budgets.py`).
    budget: BudgetHold | None = None
    #: The hold on every account in a `SharedHolds` (Redis), which replaces both above.
    shared: object | None = None


@dataclass
class _OrgView:
    """An org's spending figures as last read from the store, plus local changes since."""

    credit: CreditState | None = None  # the prepaid balance; None: postpaid
    month_spend: int = 0
    project_spend: dict[str, int] = field(default_factory=dict)
    caps: dict[str | None, int] = field(default_factory=dict)  # project (None: org) → cap
    requests_today: int = 0
    held: int = 0  # micros: the maximum cost of this process's admitted, unmetered requests
    read_at: float = float("-inf")
    # Settled here since the read began: (sequence, project, cost), oldest first. Dropped
    # once a read that started after them (and after the ledger flushed them) lands.
    local: deque[tuple[int, str | None, int]] = field(default_factory=deque)
    #: The costs in `local`, in all and per project: kept as they change, so a request's
    #: check reads them in O(1) however many requests settled since the last read.
    local_total: int = 0
    local_by_project: dict[str | None, int] = field(default_factory=dict)
    refreshing: asyncio.Task[None] | None = None

    @property
    def balance(self) -> int | None:
        """Micros, as last read; None: postpaid (no prepaid balance)."""
        return None if self.credit is None else self.credit.balance_micros

    def spent(self, project_id: str | None) -> tuple[int, int, int]:
        """(org month spend, project month spend, requests today), local changes included."""
        org = self.month_spend + self.local_total
        proj = (self.project_spend.get(project_id or "", 0)
                + self.local_by_project.get(project_id, 0))
        return org, proj, self.requests_today + len(self.local)

    def settled(self, seq: int, project_id: str | None, cost: int) -> None:
        """Count a request settled here (sequence number `seq`)."""
        self.local.append((seq, project_id, cost))
        self.local_total += cost
        self.local_by_project[project_id] = self.local_by_project.get(project_id, 0) + cost

    def forget_until(self, seq: int) -> None:
        """Drop the local entries up to sequence `seq` (a read now includes them)."""
        local, by_project = self.local, self.local_by_project
        while local and local[0][0] <= seq:
            _, project_id, cost = local.popleft()
            self.local_total -= cost
            # A project's figure is the sum of its entries left, and a missing key is 0:
            # after free (0-cost) requests it is gone before their entries are.
            left = by_project.get(project_id, 0) - cost
            if left:
                by_project[project_id] = left
            else:
                by_project.pop(project_id, None)


class Billing:
    """The pre-check and the meter, over a `Store` and a `LedgerWriter`."""

    def __init__(
        self,
        store: Store,
        ledger: LedgerWriter,
        *,
        refresh_s: float = 1.0,
        prices_refresh_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedHolds | None = None,
    ) -> None:
        """`refresh_s`: the age of an org's spending figures before a background re-read;
        `prices_refresh_s`: the same for the price list; `shared`: hold money there
        (Redis, for many gateway processes) rather than in this process."""
        self.store = store
        self.shared = shared
        self.ledger = ledger
        self.refresh_s = refresh_s
        self.prices_refresh_s = prices_refresh_s
        self._clock = clock
        self._views: dict[str, _OrgView] = {}
        self._prices: dict[str, Prices] = {}
        self._prices_read_at = float("-inf")
        self._prices_version = -1  # the store's `prices_version` the list was read at
        self._prices_task: asyncio.Task[None] | None = None
        self._seq = 0
        #: The spend budgets of keys and users (held and settled with the org's figures).
        self.budgets = Budgets(store, ledger, refresh_s=refresh_s, clock=clock)

    # -- pre-check --------------------------------------------------------------------------

    async def reserve(self, key: KeyContext, prices: Prices, max_usage: Usage) -> Hold:
        """`precheck`, and hold the cost of `max_usage` (the most the request may use, at
        its model's `prices`) against the org's prepaid balance until `release`: refused
        when the balance left less what is held does not cover it (so a balance is never
        overdrawn). With a shared store (Redis) it is held there instead, against every
        account of the request at once (`money_holds.accounts_for`). Release the hold once
        the request is metered (or never ran)."""
        view = await self._view(key.org_id)
        micros = self.cost(prices, max_usage)
        # A budget is never overspent: it holds the most the request may cost, its prompt
        # written to the prompt cache for an hour (the dearest way) included.
        dearest = (self.cost(prices, replace(max_usage,
                                             cache_write_1h_tokens=max_usage.prompt_tokens))
                   if key.key_budget or key.user_budget else 0)
        if self.shared is not None:
            self._check_free_tier(key, view)
            accounts = accounts_for(key, view.credit, view.caps,
                                    month_of(self.store.clock()), micros, dearest)
            if not accounts:
                return Hold(key.org_id, 0)
            shared = await self.shared.reserve(
                accounts, lambda missing: seed_figures(self.store, self.ledger, missing))
            return Hold(key.org_id, 0, shared=shared)
        budget = await self.budgets.reserve(key, dearest) if dearest else None
        try:
            self._check(key, view, micros)
        except APIError:
            self.budgets.release(budget)
            raise
        view.held += micros
        return Hold(key.org_id, micros, budget=budget)

    def release(self, hold: Hold | None, cost: int = 0) -> None:
        """Give a hold back: its request was metered at `cost` micros (`meter` counted
        them here; a shared store is charged them now), or never ran. Idempotent."""
        if hold is None or hold.released:
            return
        hold.released = True
        if hold.shared is not None and self.shared is not None:
            self.shared.settle(hold.shared, cost, month_of(self.store.clock()))
        self.budgets.release(hold.budget)
        view = self._views.get(hold.org_id)
        if view is not None:
            view.held -= hold.micros

    async def precheck(self, key: KeyContext) -> None:
        """Refuse (429 insufficient_quota, not retryable) an org or project that is out of
        credit (its holds included), over its monthly spend cap, or past its free tier's
        requests for today."""
        self._check(key, await self._view(key.org_id), 0)

    def _check(self, key: KeyContext, view: _OrgView, cost: int) -> None:
        """`precheck`'s refusals for a request of maximum cost `cost` (micros)."""
        org_spend, project_spend, _ = view.spent(key.project_id)
        if view.balance is not None:
            left = view.balance - (org_spend - view.month_spend)
            if err := refusal("balance", key.org_id, left=left, held=view.held, cost=cost):
                raise err
        # In one process a spend cap refuses once it is reached (no hold against it).
        for kind, subject_id, spent in (("org_cap", key.org_id, org_spend),
                                        ("project_cap", key.project_id, project_spend)):
            cap = view.caps.get(None if kind == "org_cap" else subject_id)
            if subject_id is None or cap is None:
                continue
            if err := refusal(kind, subject_id, left=cap - spent, held=0, cost=0,  # type: ignore[arg-type]
                              cap=cap):
                raise err
        self._check_free_tier(key, view)

    @staticmethod
    def _check_free_tier(key: KeyContext, view: _OrgView) -> None:
        _, _, requests_today = view.spent(key.project_id)
        allowance = key.free_tier_daily_requests
        if allowance is not None and view.balance is None and requests_today >= allowance:
            raise quota(
                f"Your organization used its free tier's {allowance} requests for today "
                "(UTC). Add credit to continue."
            )

    async def _view(self, org_id: str) -> _OrgView:
        view = self._views.get(org_id)
        if view is None:
            view = self._views[org_id] = _OrgView()
        if self._clock() - view.read_at > self.refresh_s and view.refreshing is None:
            view.refreshing = asyncio.create_task(self._refresh(org_id, view))
        if view.read_at == float("-inf") and view.refreshing is not None:
            # Never read yet (first sight of this org): the one time requests wait for a
            # read — all of them, or those beside the first would pass as postpaid.
            await asyncio.shield(view.refreshing)
        return view

    async def _refresh(self, org_id: str, view: _OrgView) -> None:
        started_seq = self._seq
        try:
            # Rows settled before this read began must be in the database when it reads;
            # bounded, so a database that is down cannot hold a request (the read below
            # then fails and the last figures stay).
            await asyncio.wait_for(self.ledger.flush(), FLUSH_WAIT_S)
            credit = await self.store.credit_state(org_id)
            month = await self.store.month_spend(org_id)
            caps = {cap.project_id: cap.cap_micros
                    for cap in await self.store.spend_caps(org_id)}
            project_spend = {
                project: await self.store.month_spend(org_id, project)
                for project in caps if project is not None
            }
            today = await self.store.requests_today(org_id)
        except Exception:
            logger.exception("billing refresh for %s failed; keeping the last figures", org_id)
            return
        finally:
            view.refreshing = None
        view.credit, view.month_spend, view.caps = credit, month, caps
        view.project_spend = project_spend
        view.requests_today = today
        view.forget_until(started_seq)
        view.read_at = self._clock()

    async def close(self) -> None:
        """Wait for the shared store's settlements under way and let its holds go."""
        if self.shared is not None:
            await self.shared.close()

    # -- metering ---------------------------------------------------------------------------

    async def prices(self, model: str) -> Prices:
        """The model's prices (micros per million tokens; none set: free). Read once, then
        refreshed in the background every `prices_refresh_s`; read again at once after a
        price was set through this process's store (the admin API of this gateway).
        Requests that must wait for a read wait for the same one: at a cold start, 8
        requests at once ran 8 reads of the whole list, each a round trip through the
        database's thread."""
        for _ in range(2):  # a read that began before the latest price change: once more
            if self._prices_version == self.store.prices_version:
                break
            if self._prices_task is None:
                self._prices_task = asyncio.create_task(self._read_prices())
            await asyncio.shield(self._prices_task)
        if (self._clock() - self._prices_read_at > self.prices_refresh_s
                and self._prices_task is None):
            self._prices_task = asyncio.create_task(self._read_prices())
        return self._prices.get(model, Prices())

    async def batch_prices(self, model: str, own: PriceSpec | None) -> Prices:
        """The model's batch prices: its deployment's `own` (the fleet entry's
        `batch_prices`), else half its live prices (rounded half up)."""
        if own is not None:
            return Prices(own.input, own.cached_input, own.output)
        return batch_prices(await self.prices(model))

    async def _read_prices(self) -> None:
        version = self.store.prices_version
        try:
            self._prices = await self.store.prices()
        except Exception:
            logger.exception("reading prices failed; keeping the last ones")
        finally:
            self._prices_read_at = self._clock()
            self._prices_version = version
            self._prices_task = None

    @staticmethod
    def cost(prices: Prices, usage: Usage) -> int:
        """Micros: uncached input, cached input, prompt-cache writes and output at the
        model's prices."""
        return cost_micros(prices, *_priced_counts(usage))

    def meter(
        self,
        key: KeyContext,
        *,
        request_id: str,
        model: str,
        endpoint: str,
        status: str,
        usage: Usage,
        prices: Prices,
        region: str | None = None,
        batch_id: str | None = None,
    ) -> UsageRecord:
        """Append the request's ledger row (off the request path) and count it locally;
        `region`: the serving deployment's."""
        record = UsageRecord(
            request_id=request_id,
            org_id=key.org_id,
            project_id=key.project_id,
            key_id=key.key_id,
            user_id=key.user_id,
            model=model,
            endpoint=endpoint,
            status=status,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            output_tokens=usage.output_tokens,
            cache_write_5m_tokens=usage.cache_write_5m_tokens,
            cache_write_1h_tokens=usage.cache_write_1h_tokens,
            cost_micros=self.cost(prices, usage),
            region=region,
            batch_id=batch_id,
        )
        self.ledger.append(record)
        self.budgets.settled(key, record.cost_micros)
        self._seq += 1
        view = self._views.get(key.org_id)
        if view is not None:
            view.settled(self._seq, key.project_id, record.cost_micros)
        return record


def _priced_counts(usage: Usage) -> tuple[int, int, int, int, int]:
    """(uncached input, cached input, output, 5-minute writes, 1-hour writes): the
    prompt split so that no token is priced twice."""
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    write_1h = min(usage.cache_write_1h_tokens, usage.prompt_tokens - cached)
    write_5m = min(usage.cache_write_5m_tokens, usage.prompt_tokens - cached - write_1h)
    return (usage.prompt_tokens - cached - write_5m - write_1h, cached, usage.output_tokens,
            write_5m, write_1h)


@dataclass(frozen=True)
class Cost:
    """What one request was charged: `micros`, the ledger row's cost (rounded once), and
    its exact line items (`cost_quarters`)."""

    micros: int
    items: dict[str, int]

    @classmethod
    def of(cls, prices: Prices, usage: Usage, micros: int) -> Cost:
        return cls(micros, cost_quarters(prices, *_priced_counts(usage)))

    def to_json(self) -> dict[str, str]:
        """Decimal strings (money is never a float here): the total charged, then each
        line item exactly; the cache-write item only when the request wrote any."""
        out = {"currency": CURRENCY, "total": format_money(self.micros)}
        out.update({name: format_exact(q) for name, q in self.items.items()
                    if q or name != "cache_write"})
        return out


def batch_prices(prices: Prices) -> Prices:
    """A batch line's prices: half the live ones, each rounded half up (OpenAI's and
    Anthropic's batch discount)."""
    return Prices(input=(prices.input + 1) // 2, cached_input=(prices.cached_input + 1) // 2,
                  output=(prices.output + 1) // 2)
