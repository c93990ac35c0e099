"""The gateway's stages in request order, behind one object the HTTP routes call.

    authenticate (3) → [parse, template, tokenize] → authorize (4) → limit (5)
    → billing pre-check (6) → … engine … → settle + meter (19)

A `Ticket` is what admission hands out (`admit_prompts` reserves what a request's
prompts and their completions may use); `Gateway.finish` settles the ticket with what
the request really used and how it ended (`call.outcome` reads them off its generations)
exactly once, whatever way the request ended (completed, stopped, aborted by the
client, failed), in a task of its own so a cancelled handler cannot leave a concurrency
slot taken.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenyard.config import ServeConfig
from tokenyard.deployments import PriceSpec
from tokenyard.errors import APIError, overloaded
from tokenyard.gateway.auth import Authenticator, authorize
from tokenyard.gateway.auth_throttle import FailedAuthThrottle
from tokenyard.gateway.billing import Billing, Cost, Hold, Usage
from tokenyard.gateway.limits import (
    Admission,
    InProcessLimiter,
    Limiter,
    RateLimited,
    Subject,
)
from tokenyard.gateway.money_holds import SharedHolds
from tokenyard.gateway.requests import RequestLog
from tokenyard.gateway.responses import StoredResponses
from tokenyard.store.db import Database
from tokenyard.store.ledger import LedgerWriter
from tokenyard.store.money import Prices
from tokenyard.store.records import KeyContext, Limits
from tokenyard.store.repo import Store
from tokenyard.telemetry import request_log
from tokenyard.telemetry.timeline import Timeline
from tokenyard.wire.sampling_params import SamplingParams

logger = logging.getLogger("tokenyard.gateway")

#: The scheduler's class of a batch's lines: below every live class (high, normal, low)
#: and shadow copies, so the engine and the balancer's queue serve them last and preempt
#: them first.
BATCH_PRIORITY = 2

#: How a request ended, as the ledger records it.
COMPLETED, STOPPED, ABORTED, FAILED = "completed", "stopped", "aborted", "failed"


@dataclass(eq=False)
class Ticket:
    """An admitted request's claim on its key's and org's limits, until `finish`."""

    key: KeyContext
    admission: Admission
    model: str
    endpoint: str
    request_id: str
    prices: Prices
    finished: bool = field(default=False)
    #: Set by `finish`: what the request used and how it ended, and what it was charged
    #: (None: not metered, nothing ran); the ledger row holds the same figures.
    usage: Usage | None = None
    status: str | None = None
    cost: Cost | None = None
    #: The request's maximum cost held against a prepaid balance until `finish`.
    hold: Hold | None = None
    #: The region of the deployment that serves it (its ledger row's).
    region: str | None = None
    #: The batch the request is a line of (None: live).
    batch_id: str | None = None

    @property
    def cost_micros(self) -> int | None:
        """What the request was billed in micros (None: not metered)."""
        return self.cost.micros if self.cost is not None else None

    @property
    def cache_salt(self) -> str:
        """The salt of the request's prefix-cache blocks: set here from the authenticated
        key (its org), never from anything the client sends."""
        return self.key.cache_salt

    @property
    def priority(self) -> int:
        """The scheduler's class of the request (the key's, else its org's; a batch's
        line: `BATCH_PRIORITY`)."""
        return BATCH_PRIORITY if self.batch_id is not None else self.key.priority


def _subjects(key: KeyContext) -> list[Subject]:
    """The key and its org, each only when it has a limit."""
    out = []
    for scope, sid, limits in (("key", key.key_id, key.key_limits),
                               ("org", key.org_id, key.org_limits)):
        if limits != Limits():
            out.append(Subject(scope, sid, limits))
    return out


class Gateway:
    """Authentication, authorization, limits, billing and metering over one store."""

    def __init__(
        self, store: Store, limiter: Limiter, billing: Billing, *, key_ttl_s: float = 1.0,
        responses_retention_days: float = ServeConfig.responses_retention_days,
        auth_failures_per_minute: int = 0,
        requests: RequestLog | None = None,
    ) -> None:
        self.store = store
        self.limiter = limiter
        self.billing = billing
        #: Request records and body capture (`GET /v1/requests/{id}`), off the path.
        self.requests = requests if requests is not None else RequestLog(store)
        self.auth = Authenticator(store.find_key, ttl_s=key_ttl_s)
        #: The Responses API's stored responses (their purge runs once `open` starts it).
        self.responses = StoredResponses(store, retention_days=responses_retention_days,
                                         region=self.requests.region)
        self.auth_throttle = FailedAuthThrottle(auth_failures_per_minute)
        self._settling: set[asyncio.Task[None]] = set()
        #: Limiter admissions taken and not yet settled back (each holds its subjects'
        #: concurrency slots until then). Read-only figure: once traffic stops it must come
        #: back to 0, which the reliability suite checks through the dashboard.
        self.admissions_open = 0
        #: Live requests (not batch lines) admitted and not finished: the batch lane
        #: yields to them.
        self.live_open = 0

    @classmethod
    async def open(
        cls, database_url: str, limiter: Limiter, journal_dir: Path,
        *, config: ServeConfig | None = None, money: SharedHolds | None = None,
    ) -> tuple[Gateway, str | None]:
        """Open the store (migrating it), start the ledger writer (replaying what a crashed
        gateway left in its journal) and the purge of expired stored responses, and create
        the default org on an empty database.
        `config` sets the caches' lifetimes and the ledger's batching (default: defaults);
        `money`: hold money there for every gateway process (Redis), else in this one.
        Returns the gateway and the new development key's secret (None if not new)."""
        config = config or ServeConfig()
        db = await Database.open(database_url)
        try:
            store = Store(db)
            ledger = LedgerWriter(db, journal_dir, config.ledger_flush_interval_s,
                                  config.ledger_max_batch)
            await ledger.start()
            dev_key = await store.ensure_default_org(config.admin_key)
        except BaseException:
            await db.close()
            raise
        billing = Billing(store, ledger, refresh_s=config.billing_refresh_s,
                          prices_refresh_s=config.prices_refresh_s, shared=money)
        requests = RequestLog(store, config)
        await requests.start()
        request_log.add_observer(requests.observe)
        gateway = cls(store, limiter, billing, key_ttl_s=config.key_cache_ttl_s,
                      responses_retention_days=config.responses_retention_days,
                      auth_failures_per_minute=config.auth_failures_per_minute,
                      requests=requests)
        gateway.responses.start()
        return gateway, dev_key

    async def close(self) -> None:
        """Wait for pending settlements, flush the ledger, close everything."""
        await self.responses.close()
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        request_log.remove_observer(self.requests.observe)
        await self.requests.close()
        await self.billing.close()
        await self.billing.ledger.close(timeout=10.0)
        await self.limiter.close()
        await self.store.db.close()

    async def set_prices(self, prices: Mapping[str, PriceSpec]) -> None:
        """Write the fleet file's prices (per deployment) into the price list."""
        for model, spec in prices.items():
            await self.store.set_price(model, input=spec.input,
                                       cached_input=spec.cached_input, output=spec.output)

    async def authenticate(
        self, headers: Mapping[str, str], timeline: Timeline, address: str | None = None,
    ) -> KeyContext:
        """The calling key; 401 for a bad one, 429 for an `address` (the TCP peer) that
        failed too often of late (gateway/auth_throttle.py)."""
        self.auth_throttle.check(address)
        try:
            key = await self.auth.authenticate(headers)
        except APIError as err:
            if err.status == 401:
                self.auth_throttle.failed(address)
            raise
        except Exception as exc:  # the store is down: the client may retry, not a 500
            raise _unavailable("key store", exc) from None
        timeline.mark("authenticated")
        return key

    async def admit(
        self,
        key: KeyContext,
        *,
        model: str,
        endpoint: str,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        timeline: Timeline,
        context_tokens: int | None = None,
        alias: str | None = None,
        region: str | None = None,
        batch: str | None = None,
        own_batch_prices: PriceSpec | None = None,
        counted: bool = False,
    ) -> Ticket:
        """Stages 4–6 for a request of `prompt_tokens` that may generate `max_tokens`
        (all completions together): its scopes, its limits (reserving prompt + max_tokens
        from the token buckets) and the billing pre-check (holding the request's maximum
        cost against a prepaid balance until `finish`). `context_tokens`: the longest
        single sequence (prompt + its max_tokens), which the key's context scope caps;
        default prompt + max_tokens. `model` is the deployment; `alias`, the name the
        client asked for, which a key's model scope may name instead; `region`, the
        deployment's, which its ledger row records; `batch`, the batch the request is a
        line of, priced at the deployment's `own_batch_prices` (its fleet entry's), else
        at half its live prices. `counted`: the request already took its one request
        from the RPM buckets (an earlier attempt of it, a fallback's), so this takes none.
        """
        authorize(key, model, prompt_tokens + max_tokens if context_tokens is None
                  else context_tokens, alias=alias)
        timeline.mark("authorized")
        try:
            admission = await self.limiter.admit(_subjects(key), prompt_tokens + max_tokens,
                                                 requests=0 if counted else 1)
        except RateLimited as refusal:
            raise RateLimitExceeded(refusal) from None
        except Exception as exc:  # Redis is down
            raise _unavailable("rate limiter", exc) from None
        self.admissions_open += 1
        timeline.mark("limited")
        ticket = Ticket(key, admission, model, endpoint, request_id, Prices(), region=region,
                        batch_id=batch)
        self.live_open += batch is None
        try:
            ticket.prices = (await self.billing.prices(model) if batch is None
                             else await self.billing.batch_prices(model, own_batch_prices))
            ticket.hold = await self.billing.reserve(
                key, ticket.prices, Usage(prompt_tokens, 0, max_tokens))
        except APIError:
            self.finish(ticket, None, FAILED)
            raise
        except Exception as exc:  # the store or Redis is down
            self.finish(ticket, None, FAILED)
            raise _unavailable("billing", exc) from None
        except BaseException:
            self.finish(ticket, None, FAILED)
            raise
        timeline.mark("prechecked")
        return ticket

    async def admit_prompts(
        self,
        key: KeyContext,
        *,
        model: str,
        endpoint: str,
        request_id: str,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        timeline: Timeline,
        alias: str | None = None,
        region: str | None = None,
        batch: str | None = None,
        own_batch_prices: PriceSpec | None = None,
        counted: bool = False,
    ) -> Ticket:
        """`admit` for a request of `prompts`, each with its fitted `params`: it reserves
        every prompt token and every token the n completions of each may generate, and
        the context scope caps the longest single sequence."""
        return await self.admit(
            key, model=model, endpoint=endpoint, request_id=request_id,
            prompt_tokens=sum(len(p) for p in prompts),
            max_tokens=sum((p.max_tokens or 0) * p.n for p in params),
            context_tokens=max(len(p) + (fp.max_tokens or 0)
                               for p, fp in zip(prompts, params, strict=True)),
            timeline=timeline, alias=alias, region=region, batch=batch,
            own_batch_prices=own_batch_prices, counted=counted,
        )

    def finish(self, ticket: Ticket, usage: Usage | None, status: str) -> None:
        """Settle the reservation with the real usage (None: nothing ran), release the
        concurrency slots, and meter the request if it produced tokens. Idempotent."""
        if ticket.finished:
            return
        ticket.finished = True
        self.live_open -= ticket.batch_id is None
        ticket.usage, ticket.status = usage, status
        if usage is not None and (usage.output_tokens or status != FAILED):
            record = self.billing.meter(
                ticket.key, request_id=ticket.request_id, model=ticket.model,
                endpoint=ticket.endpoint, status=status, usage=usage, prices=ticket.prices,
                region=ticket.region, batch_id=ticket.batch_id,
            )
            ticket.cost = Cost.of(ticket.prices, usage, record.cost_micros)
        self.billing.release(ticket.hold, ticket.cost_micros or 0)
        used = usage.total_tokens if usage is not None else 0
        if isinstance(self.limiter, InProcessLimiter):  # no I/O: settled here, no task
            try:
                self.limiter.settle_now(ticket.admission, used)
            except Exception:
                logger.exception("settling a rate-limit reservation failed")
            finally:
                self.admissions_open -= 1
            return
        task = asyncio.get_running_loop().create_task(self._settle(ticket.admission, used))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, admission: Admission, used: int) -> None:
        try:
            await self.limiter.settle(admission, used)
        except Exception:
            logger.exception("settling a rate-limit reservation failed")
        finally:
            self.admissions_open -= 1


def _unavailable(what: str, exc: Exception) -> APIError:
    """503 (529 on Anthropic routes) with retry-after, for a backing service that failed."""
    logger.warning("the gateway's %s failed: %r", what, exc)
    return overloaded(1.0, f"The gateway's {what} is unavailable; retry after a short wait.")


# ---------------------------------------------------------------------------- refusals


class RateLimitExceeded(APIError):
    """429 rate_limit_exceeded with retry-after (s) and retry-after-ms; `state` is the
    limit, remaining and reset figures, which each dialect renders as its own headers."""

    def __init__(self, refusal: RateLimited) -> None:
        retry = max(refusal.retry_after, 0.001)
        headers = {"retry-after": str(max(1, math.ceil(retry))),
                   "retry-after-ms": str(math.ceil(retry * 1000))}
        if refusal.never_fits:
            headers["x-should-retry"] = "false"
        super().__init__(429, refusal.message(), code="rate_limit_exceeded", headers=headers)
        self.state = refusal.state
