"""The values the store hands out: frozen dataclasses, so callers never hold a session."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from fnmatch import fnmatchcase
from typing import Any, Literal

IdemOutcome = Literal["new", "running", "mismatch", "replay"]
GroupBy = Literal["key", "user", "project", "org", "model", "day", "region", "batch"]

#: Priority classes by name: the engine's scheduler runs lower values first (by class,
#: then arrival). An org has one (default normal); a key may override its org's.
PRIORITY_CLASSES: dict[str, int] = {"high": -1, "normal": 0, "low": 1}


def priority_name(value: int | None) -> str | None:
    """The class name of a priority value (None stays None: a key that inherits)."""
    if value is None:
        return None
    names = {v: k for k, v in PRIORITY_CLASSES.items()}
    return names.get(value, str(value))


@dataclass(frozen=True)
class Scopes:
    """What a key may do: models (globs; empty = all), a context cap, admin rights."""

    models: tuple[str, ...] = ()
    max_context_tokens: int | None = None  # prompt + max_tokens; None: the model's own
    admin: bool = False

    def allows_model(self, model: str) -> bool:
        """Whether `model` matches one of the globs (or no globs are set)."""
        return not self.models or any(fnmatchcase(model, glob) for glob in self.models)

    def to_json(self) -> dict[str, Any]:
        """The JSON object stored in `api_keys.scopes`."""
        return {
            "models": list(self.models),
            "max_context_tokens": self.max_context_tokens,
            "admin": self.admin,
        }

    @classmethod
    def from_json(cls, value: dict[str, Any] | None) -> Scopes:
        """Inverse of `to_json`; missing fields take their defaults."""
        value = value or {}
        return cls(
            models=tuple(value.get("models") or ()),
            max_context_tokens=value.get("max_context_tokens"),
            admin=bool(value.get("admin", False)),
        )


@dataclass(frozen=True)
class Limits:
    """Rate limits of a key or an org; None means unlimited."""

    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute (prompt + max_tokens reserved)
    max_concurrency: int | None = None  # requests in flight


@dataclass(frozen=True)
class OrgRecord:
    id: str
    name: str
    limits: Limits
    free_tier_daily_requests: int | None
    created_at: datetime
    priority: int = 0  # the scheduler's class of the org's requests (PRIORITY_CLASSES)
    #: The regions whose deployments may serve its requests (None: any).
    allowed_regions: tuple[str, ...] | None = None
    #: The estimated tokens its batches at work may hold (None: the gateway's default).
    batch_enqueued_tokens: int | None = None


@dataclass(frozen=True)
class ProjectRecord:
    id: str
    org_id: str
    name: str
    created_at: datetime
    #: Narrows its org's allowed regions (None: the org's).
    allowed_regions: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Budget:
    """A key's or a user's spend budget in micros, each None when unset: a cap per UTC
    calendar month and a cap on all its spend."""

    monthly_micros: int | None = None
    total_micros: int | None = None

    def __bool__(self) -> bool:
        return self.monthly_micros is not None or self.total_micros is not None


NO_BUDGET = Budget()


@dataclass(frozen=True)
class UserRecord:
    """A user of an org; `project_id`, the project its keys default to (None: none)."""

    id: str
    org_id: str
    email: str
    created_at: datetime
    name: str | None = None
    project_id: str | None = None
    budget: Budget = NO_BUDGET


@dataclass(frozen=True)
class ApiKeyRecord:
    """An API key as listed by admins; the secret is not part of it (it is not stored)."""

    id: str
    org_id: str
    project_id: str | None
    user_id: str | None
    name: str
    prefix: str  # the visible head of the secret, e.g. "sk-ty-AbCd"
    scopes: Scopes
    limits: Limits
    expires_at: datetime | None
    revoked_at: datetime | None
    created_at: datetime
    priority: int | None = None  # the scheduler's class; None: the org's
    budget: Budget = NO_BUDGET


@dataclass(frozen=True)
class KeyContext:
    """Everything the gateway needs per request about the key that authenticated it."""

    key_id: str
    key_name: str
    prefix: str
    org_id: str
    project_id: str | None
    user_id: str | None
    scopes: Scopes
    key_limits: Limits
    org_limits: Limits
    expires_at: datetime | None
    revoked_at: datetime | None
    free_tier_daily_requests: int | None  # of the org; None: no free tier
    #: The scheduler's class for this key's requests (lower runs first; 0 is normal): the
    #: key's own, else its org's.
    priority: int = 0
    #: The regions whose deployments may serve this key's requests: its org's, narrowed by
    #: its project's (None: any region).
    allowed_regions: frozenset[str] | None = None
    #: The spend budgets of the key and of its user, checked at admission (`Budgets`).
    key_budget: Budget = NO_BUDGET
    user_budget: Budget = NO_BUDGET

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of this key's requests: its org, so no tenant's cached
        blocks are ever hit by another tenant's prompt."""
        return self.org_id

    def is_active(self, now: datetime) -> bool:
        """Neither revoked nor expired at `now` (an aware UTC datetime)."""
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)


@dataclass(frozen=True)
class SpendCap:
    org_id: str
    project_id: str | None  # None: the cap is on the whole org
    cap_micros: int  # per calendar month, UTC


@dataclass(frozen=True)
class CreditState:
    """A prepaid balance as one read saw it: `balance_micros` (credits less the ledger's
    debits), and `credited_micros`, the sum of every admin credit or debit, the
    `credit_seq`-th of them the last."""

    balance_micros: int
    credited_micros: int
    credit_seq: int


@dataclass(frozen=True)
class UsageRow:
    """One group of a usage report; tokens are counts, cost in micros."""

    group: str | None  # None where the grouping column is empty (e.g. a request without project)
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    cost_micros: int


@dataclass(frozen=True)
class IdempotencyRecord:
    """A stored response (state 'done') or a claim on a key by a request in flight."""

    org_id: str
    key: str
    body_hash: str  # SHA-256 hex of the request body
    state: Literal["running", "done"]
    status_code: int | None
    headers: dict[str, str]
    body: bytes | None
    created_at: datetime
    expires_at: datetime
    api_key_id: str = ""  # the API key whose record it is ('': none was named)
    route: str = ""  # what it was first sent to, e.g. "POST /v1/chat/completions"
