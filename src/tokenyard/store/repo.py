"""The Store: every read and write of orgs, projects, users and keys, as async methods (prices,
balances and caps come from `accounts.py`).

Methods return frozen dataclasses (`records.py`), never ORM objects, so callers never
touch a session. Usage reports live in `reports.py` and idempotency in `idempotency.py`;
the Store exposes them too so that the gateway needs one object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from tokenyard.store import idempotency, regions
from tokenyard.store.accounts import Accounts
from tokenyard.store.db import Database
from tokenyard.store.ids import new_id
from tokenyard.store.keys import hash_secret, new_secret, visible_prefix
from tokenyard.store.records import (
    NO_BUDGET,
    ApiKeyRecord,
    Budget,
    IdemOutcome,
    IdempotencyRecord,
    KeyContext,
    Limits,
    OrgRecord,
    ProjectRecord,
    Scopes,
)
from tokenyard.store.sql import utcnow
from tokenyard.store.tables import (
    api_keys,
    balances,
    orgs,
    projects,
    users,
)
from tokenyard.store.users import Users, budget_of

DEFAULT_ORG_ID = "org_default"  # fixed, so two gateways starting at once create it only once
DEFAULT_PROJECT_ID = "proj_default"
#: The limits of the org `serve` creates on first start: generous for one machine (about
#: what one replica can hold), yet the limiter runs and answers x-ratelimit-* headers from
#: the first request. docs/operations.md documents them.
DEFAULT_ORG_LIMITS = Limits(rpm=10_000, tpm=10_000_000, max_concurrency=1_024)


class Store(Accounts, Users):
    """Async access to the gateway's state over one open `Database`; the money side
    (prices, balances, spend caps, spend) comes from `Accounts`, users and budgets from
    `Users`."""

    def __init__(self, db: Database, clock: Callable[[], datetime] = utcnow) -> None:
        self.db = db
        self.clock = clock  # aware UTC now; tests pass a fake one
        #: Counts the price changes made through this Store, so that a price cache over
        #: it (billing) can read them at once rather than at its next refresh.
        self.prices_version = 0

    # -- orgs, projects, users ---------------------------------------------------------

    async def create_org(
        self,
        name: str,
        *,
        balance_micros: int | None = None,
        free_tier_daily_requests: int | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        max_concurrency: int | None = None,
        priority: int = 0,
    ) -> OrgRecord:
        """A new org; with `balance_micros` it is prepaid (a balance row), else postpaid.
        `priority`: the scheduler's class of its requests (lower first; 0 normal)."""
        row = {
            "id": new_id("org"),
            "name": name,
            "rpm": rpm,
            "tpm": tpm,
            "max_concurrency": max_concurrency,
            "free_tier_daily_requests": free_tier_daily_requests,
            "priority": priority,
            "created_at": self.clock(),
        }
        async with self.db.engine.begin() as conn:
            await conn.execute(orgs.insert().values(row))
            if balance_micros is not None:
                await conn.execute(
                    balances.insert().values(org_id=row["id"], balance_micros=balance_micros)
                )
        return _org(row)

    async def get_org(self, org_id: str) -> OrgRecord | None:
        """The org with id `org_id`, or None."""
        async with self.db.engine.connect() as conn:
            row = (await conn.execute(select(orgs).where(orgs.c.id == org_id))).mappings().first()
        return _org(row) if row else None

    async def list_orgs(self) -> list[OrgRecord]:
        """All orgs, oldest first."""
        async with self.db.engine.connect() as conn:
            rows = (await conn.execute(select(orgs).order_by(orgs.c.created_at))).mappings()
            return [_org(row) for row in rows]

    async def set_org_limits(
        self,
        org_id: str,
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        max_concurrency: int | None = None,
        free_tier_daily_requests: int | None = None,
        batch_enqueued_tokens: int | None = None,
    ) -> bool:
        """Replace all of the org's limits (None: unlimited / no free tier / the
        gateway's default batch quota); False if no org."""
        values = {
            "rpm": rpm,
            "tpm": tpm,
            "max_concurrency": max_concurrency,
            "free_tier_daily_requests": free_tier_daily_requests,
            "batch_enqueued_tokens": batch_enqueued_tokens,
        }
        async with self.db.engine.begin() as conn:
            result = await conn.execute(update(orgs).where(orgs.c.id == org_id).values(values))
        return result.rowcount == 1

    async def set_org_priority(self, org_id: str, priority: int) -> bool:
        """Set the scheduler class of the org's requests (keys without their own follow
        it); False if no such org."""
        async with self.db.engine.begin() as conn:
            result = await conn.execute(
                update(orgs).where(orgs.c.id == org_id).values(priority=priority)
            )
        return result.rowcount == 1

    async def create_project(self, org_id: str, name: str) -> ProjectRecord:
        """A new project in `org_id`; LookupError if the org does not exist."""
        project = ProjectRecord(new_id("proj"), org_id, name, self.clock())
        await self._insert_owned(projects, asdict(project), f"org {org_id}")
        return project

    async def list_projects(self, org_id: str) -> list[ProjectRecord]:
        """The org's projects, oldest first."""
        query = select(projects).where(projects.c.org_id == org_id).order_by(projects.c.created_at)
        async with self.db.engine.connect() as conn:
            return [ProjectRecord(**{**row, "allowed_regions": regions.region_list(
                row["allowed_regions"])}) for row in (await conn.execute(query)).mappings()]

    # -- API keys ----------------------------------------------------------------------

    async def create_api_key(
        self,
        org_id: str,
        *,
        name: str,
        project_id: str | None = None,
        user_id: str | None = None,
        scopes: Scopes = Scopes(),  # noqa: B008 (frozen, so sharing the default is safe)
        rpm: int | None = None,
        tpm: int | None = None,
        max_concurrency: int | None = None,
        expires_at: datetime | None = None,
        priority: int | None = None,
        budget: Budget = NO_BUDGET,
    ) -> tuple[str, ApiKeyRecord]:
        """A new key: returns (secret, record). The secret exists only in this return value.
        `priority`: the scheduler's class of its requests; None follows the org's.

        LookupError if the org, project or user does not exist or belongs to another org.
        """
        for table, owned_id in ((projects, project_id), (users, user_id)):
            if owned_id is not None and await self._owner_of(table, owned_id) != org_id:
                raise LookupError(f"{owned_id} is not in org {org_id}")
        secret = new_secret()
        row = {
            "id": new_id("key"),
            "org_id": org_id,
            "project_id": project_id,
            "user_id": user_id,
            "name": name,
            "prefix": visible_prefix(secret),
            "secret_hash": hash_secret(secret),
            "scopes": scopes.to_json(),
            "rpm": rpm,
            "tpm": tpm,
            "max_concurrency": max_concurrency,
            "priority": priority,
            "monthly_budget_micros": budget.monthly_micros,
            "total_budget_micros": budget.total_micros,
            "expires_at": expires_at,
            "revoked_at": None,
            "created_at": self.clock(),
        }
        await self._insert_owned(api_keys, row, f"org {org_id}")
        return secret, _api_key(row)

    async def find_key_by_id(self, key_id: str) -> KeyContext | None:
        """`find_key` by the key's id (a batch's lines run under the key that made it)."""
        return await self.find_key("", key_id=key_id)

    async def find_key(self, secret: str, *, key_id: str | None = None) -> KeyContext | None:
        """The key whose secret is `secret` with its org's limits, its priority (its
        own, else its org's) and its allowed regions (`regions.allowed`), by one indexed
        query.

        Revoked and expired keys are returned too (see `KeyContext.is_active`), so that
        the gateway can say why a key is refused.
        """
        query = (
            select(
                api_keys,
                orgs.c.rpm.label("org_rpm"),
                orgs.c.tpm.label("org_tpm"),
                orgs.c.max_concurrency.label("org_max_concurrency"),
                orgs.c.free_tier_daily_requests,
                orgs.c.priority.label("org_priority"),
                users.c.monthly_budget_micros.label("user_monthly_budget_micros"),
                users.c.total_budget_micros.label("user_total_budget_micros"),
                orgs.c.allowed_regions.label("org_regions"),
                projects.c.allowed_regions.label("project_regions"),
            )
            .join(orgs, orgs.c.id == api_keys.c.org_id)
            .outerjoin(users, users.c.id == api_keys.c.user_id)
            .outerjoin(projects, projects.c.id == api_keys.c.project_id)
            .where(api_keys.c.secret_hash == hash_secret(secret) if key_id is None
                   else api_keys.c.id == key_id)
        )
        async with self.db.engine.connect() as conn:
            row = (await conn.execute(query)).mappings().first()
        if row is None:
            return None
        return KeyContext(
            key_id=row["id"],
            key_name=row["name"],
            prefix=row["prefix"],
            org_id=row["org_id"],
            project_id=row["project_id"],
            user_id=row["user_id"],
            scopes=Scopes.from_json(row["scopes"]),
            key_limits=Limits(row["rpm"], row["tpm"], row["max_concurrency"]),
            org_limits=Limits(row["org_rpm"], row["org_tpm"], row["org_max_concurrency"]),
            expires_at=row["expires_at"],
            revoked_at=row["revoked_at"],
            free_tier_daily_requests=row["free_tier_daily_requests"],
            priority=row["org_priority"] if row["priority"] is None else row["priority"],
            key_budget=budget_of(row),
            user_budget=budget_of(row, "user_"),
            allowed_regions=regions.allowed(row["org_regions"], row["project_regions"]),
        )

    async def list_keys(self, org_id: str | None = None) -> list[ApiKeyRecord]:
        """Keys of `org_id` (or of every org), oldest first; revoked ones included."""
        query = select(api_keys).order_by(api_keys.c.created_at)
        if org_id is not None:
            query = query.where(api_keys.c.org_id == org_id)
        async with self.db.engine.connect() as conn:
            return [_api_key(row) for row in (await conn.execute(query)).mappings()]

    async def revoke_key(self, key_id: str) -> bool:
        """Revoke a key now; False if it does not exist or was already revoked."""
        query = (
            update(api_keys)
            .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
            .values(revoked_at=self.clock())
        )
        async with self.db.engine.begin() as conn:
            return (await conn.execute(query)).rowcount == 1

    async def set_key_limits(
        self,
        key_id: str,
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        max_concurrency: int | None = None,
    ) -> bool:
        """Replace all three of the key's limits (None: unlimited); False if no such key."""
        query = (
            update(api_keys)
            .where(api_keys.c.id == key_id)
            .values(rpm=rpm, tpm=tpm, max_concurrency=max_concurrency)
        )
        async with self.db.engine.begin() as conn:
            return (await conn.execute(query)).rowcount == 1

    async def set_key_priority(self, key_id: str, priority: int | None) -> bool:
        """Set the scheduler class of the key's requests (None: follow its org's); False
        if no such key."""
        query = update(api_keys).where(api_keys.c.id == key_id).values(priority=priority)
        async with self.db.engine.begin() as conn:
            return (await conn.execute(query)).rowcount == 1

    # -- idempotency (idempotency.py) --------------------------------------------------

    async def idem_begin(
        self,
        org_id: str,
        key: str,
        body_hash: str,
        ttl_s: float = idempotency.DEFAULT_TTL_S,
        running_lease_s: float = idempotency.DEFAULT_RUNNING_LEASE_S,
        owner: str | None = None,
        owner_is_dead: Callable[[str], bool] | None = None,
        *,
        api_key_id: str = "",
        route: str = "",
    ) -> tuple[IdemOutcome, IdempotencyRecord | None]:
        """Claim an Idempotency-Key of an API key on a route (see `idempotency.begin`)."""
        return await idempotency.begin(
            self.db.engine, self.clock(), org_id, key, body_hash, ttl_s, running_lease_s,
            owner, owner_is_dead, api_key_id=api_key_id, route=route,
        )

    async def idem_complete(
        self, org_id: str, key: str, status: int, headers: dict[str, str], body: bytes,
        *, api_key_id: str = "",
    ) -> bool:
        """Store the response of a claimed key for replay (see `idempotency.complete`)."""
        return await idempotency.complete(self.db.engine, org_id, key, status, headers, body,
                                          api_key_id=api_key_id)

    async def idem_release(self, org_id: str, key: str, *, api_key_id: str = "") -> bool:
        """Drop the claim of a failed request so that a retry may run (see `.release`)."""
        return await idempotency.release(self.db.engine, org_id, key, api_key_id=api_key_id)

    # -- first start -------------------------------------------------------------------

    async def ensure_default_org(self, admin_key: str | None = None) -> str | None:
        """On an empty database: org "default" (with `DEFAULT_ORG_LIMITS`), project
        "default" and an admin key: `admin_key` (the operator's) or a new one.

        Returns the admin key's secret, the only time a generated one is available; None
        when some org already exists (or another process created the default one first).
        """
        async with self.db.engine.connect() as conn:
            if (await conn.execute(select(func.count()).select_from(orgs))).scalar_one():
                return None
        now = self.clock()
        secret = admin_key or new_secret()
        try:
            async with self.db.engine.begin() as conn:
                await conn.execute(orgs.insert().values(
                    id=DEFAULT_ORG_ID, name="default", created_at=now,
                    **asdict(DEFAULT_ORG_LIMITS),
                ))
                await conn.execute(
                    projects.insert().values(
                        id=DEFAULT_PROJECT_ID,
                        org_id=DEFAULT_ORG_ID,
                        name="default",
                        created_at=now,
                    )
                )
                await conn.execute(
                    api_keys.insert().values(
                        id=new_id("key"),
                        org_id=DEFAULT_ORG_ID,
                        project_id=DEFAULT_PROJECT_ID,
                        name="admin",
                        prefix=visible_prefix(secret),
                        secret_hash=hash_secret(secret),
                        scopes=Scopes(admin=True).to_json(),
                        created_at=now,
                    )
                )
        except IntegrityError:
            return None  # a concurrent first start won the race for org_default
        return secret

    # -- helpers -----------------------------------------------------------------------

    async def _insert_owned(self, table: Any, row: dict[str, Any], owner: str) -> None:
        # The foreign key is the existence check: no read-then-write race.
        try:
            async with self.db.engine.begin() as conn:
                await conn.execute(table.insert().values(row))
        except IntegrityError:
            raise LookupError(f"{owner} does not exist") from None

    async def _owner_of(self, table: Any, row_id: str) -> str | None:
        async with self.db.engine.connect() as conn:
            query = select(table.c.org_id).where(table.c.id == row_id)
            return (await conn.execute(query)).scalar_one_or_none()


def _org(row: Any) -> OrgRecord:
    return OrgRecord(
        id=row["id"],
        name=row["name"],
        limits=Limits(row["rpm"], row["tpm"], row["max_concurrency"]),
        free_tier_daily_requests=row["free_tier_daily_requests"],
        created_at=row["created_at"],
        priority=row["priority"],
        allowed_regions=regions.region_list(row.get("allowed_regions")),
        batch_enqueued_tokens=row.get("batch_enqueued_tokens"),
    )


def _api_key(row: Any) -> ApiKeyRecord:
    return ApiKeyRecord(
        id=row["id"],
        org_id=row["org_id"],
        project_id=row["project_id"],
        user_id=row["user_id"],
        name=row["name"],
        prefix=row["prefix"],
        scopes=Scopes.from_json(row["scopes"]),
        limits=Limits(row["rpm"], row["tpm"], row["max_concurrency"]),
        expires_at=row["expires_at"],
        revoked_at=row["revoked_at"],
        created_at=row["created_at"],
        priority=row["priority"],
        budget=budget_of(row),
    )
