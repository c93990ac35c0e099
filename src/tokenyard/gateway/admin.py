"""Administration: orgs, projects, keys, limits, prices, credit, spend caps, usage reports,
body capture.

One set of operations behind both `tokenyard admin …` (which opens the store itself) and
`/admin/v1/…` (admin-scoped keys). Each takes plain JSON-like arguments, validates them
(`AdminError` names the field at fault) and returns JSON-ready dicts; money goes in and
out as decimal strings ("12.50") and is stored in integer micro-units. Priority classes go
in and out by name: "high", "normal" (the default) or "low" (`PRIORITY_CLASSES`); a key's
may also be "org" (or null): it follows its org's. A boolean is a JSON boolean, nothing
else (`flag`).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any, cast, get_args

from tokenyard.gateway.requests import DEFAULT_CAPTURE_DAYS, RequestLog
from tokenyard.gateway.shadow import shadow_report_of
from tokenyard.store.money import format_money, parse_money
from tokenyard.store.records import (
    PRIORITY_CLASSES,
    ApiKeyRecord,
    Budget,
    GroupBy,
    OrgRecord,
    Scopes,
    UsageRow,
    priority_name,
)
from tokenyard.store.repo import Store
from tokenyard.store.requests import capture_settings

Json = dict[str, Any]
GROUPS: tuple[str, ...] = get_args(GroupBy)


class AdminError(ValueError):
    """A bad administrative request: `field` names the argument at fault."""

    #: The HTTP status of the refusal.
    status = 400

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field


class NotFound(AdminError):
    """The org, project, key or user that `field` names does not exist (where a route
    names it: in the path, or the body's `org_id`)."""

    status = 404


# ---------------------------------------------------------------------------- arguments


def _opt_int(args: Mapping[str, Any], name: str) -> int | None:
    value = args.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise AdminError(name, f"{name} must be a whole number")
    try:
        number = int(value)
    except ValueError:
        raise AdminError(name, f"{name} must be a whole number") from None
    if number < 0:
        raise AdminError(name, f"{name} must be >= 0")
    return number


def flag(args: Mapping[str, Any], name: str, default: bool) -> bool:
    """A boolean argument: JSON true or false only. A truthy stand-in ("false", 0, 1,
    "yes") is refused, not coerced: `bool("false")` is True, and one such argument once
    made an admin key. Absent gives `default`; null counts as absent only where that
    default is false, so that a null never switches anything on."""
    if name not in args or (args[name] is None and not default):
        return default
    value = args[name]
    if not isinstance(value, bool):
        raise AdminError(name, f"{name} must be a JSON boolean, true or false")
    return value


def _str(args: Mapping[str, Any], name: str, required: bool = True) -> str | None:
    value = args.get(name)
    if value is None or value == "":
        if required:
            raise AdminError(name, f"{name} is required")
        return None
    if not isinstance(value, str):
        raise AdminError(name, f"{name} must be a string")
    return value


def _money(args: Mapping[str, Any], name: str, required: bool = False) -> int | None:
    value = args.get(name)
    if value is None:
        if required:
            raise AdminError(name, f"{name} is required")
        return None
    try:
        return parse_money(str(value))
    except ValueError as exc:
        raise AdminError(name, f"{name}: {exc}") from None


def _time(args: Mapping[str, Any], name: str) -> datetime | None:
    value = _str(args, name, required=False)
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise AdminError(name, f"{name} must be an ISO 8601 date or time") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _models(args: Mapping[str, Any]) -> tuple[str, ...]:
    value = args.get("models")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [m for m in value.split(",") if m]
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise AdminError("models", "models must be a list of model names or globs")
    return tuple(value)


def _flat_scopes(args: Mapping[str, Any]) -> Mapping[str, Any]:
    """A key's arguments with its `scopes` object (the shape a key is listed with) lifted
    to the top, where `models`, `max_context_tokens` and `admin` are read; a field given
    both ways is refused rather than one of them dropped."""
    scopes = args.get("scopes")
    if scopes is None:
        return args
    if not isinstance(scopes, dict):
        raise AdminError("scopes", "scopes must be an object {models, max_context_tokens, "
                                   "admin}")
    for name in scopes:
        if name in args:
            raise AdminError(name, f"{name} is given both at the top and in scopes")
        if name not in SCOPE_FIELDS:
            raise AdminError(f"scopes.{name}", f"scopes has no field {name}")
    return {**{k: v for k, v in args.items() if k != "scopes"}, **scopes}


#: The fields of a key's `scopes` object.
SCOPE_FIELDS = ("models", "max_context_tokens", "admin")


def budget_arg(args: Mapping[str, Any]) -> Budget:
    """`monthly_budget` and `total_budget` (decimal strings; absent or null: none)."""
    return Budget(_money(args, "monthly_budget"), _money(args, "total_budget"))


def budget_json(budget: Budget) -> Json:
    return {name: None if micros is None else format_money(micros)
            for name, micros in (("monthly_budget", budget.monthly_micros),
                                 ("total_budget", budget.total_micros))}


def _limits(args: Mapping[str, Any]) -> dict[str, int | None]:
    return {name: _opt_int(args, name) for name in ("rpm", "tpm", "max_concurrency")}


#: The names that make a key follow its org's priority class.
FOLLOW_ORG = ("org", None)


def _priority(args: Mapping[str, Any], *, follow_org: bool) -> int | None:
    """A priority class by name; with `follow_org`, "org" or null give None (the org's)."""
    value = args.get("priority")
    if follow_org and value in FOLLOW_ORG:
        return None
    if isinstance(value, str) and value.lower() in PRIORITY_CLASSES:
        return PRIORITY_CLASSES[value.lower()]
    names = ", ".join(PRIORITY_CLASSES) + (" or org" if follow_org else "")
    raise AdminError("priority", f"priority must be one of {names}")


# ---------------------------------------------------------------------------- views


def _time_text(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def org_json(org: OrgRecord, balance: int | None = None) -> Json:
    return {
        "id": org.id, "name": org.name, **asdict(org.limits),
        "free_tier_daily_requests": org.free_tier_daily_requests,
        "priority": priority_name(org.priority),
        "allowed_regions": None if org.allowed_regions is None else list(org.allowed_regions),
        "batch_enqueued_tokens": org.batch_enqueued_tokens,
        "balance": format_money(balance) if balance is not None else None,
        "created_at": _time_text(org.created_at),
    }


def key_json(key: ApiKeyRecord) -> Json:
    return {
        "id": key.id, "org_id": key.org_id, "project_id": key.project_id,
        "user_id": key.user_id, "name": key.name,
        "prefix": key.prefix, "scopes": key.scopes.to_json(), **asdict(key.limits),
        "priority": priority_name(key.priority) or "org", **budget_json(key.budget),
        "expires_at": _time_text(key.expires_at), "revoked_at": _time_text(key.revoked_at),
        "created_at": _time_text(key.created_at),
    }


def usage_json(row: UsageRow) -> Json:
    return {**asdict(row), "cost": format_money(row.cost_micros)}


# ---------------------------------------------------------------------------- operations


class Admin:
    """The administrative operations over one `Store`."""

    def __init__(self, store: Store, requests: RequestLog | None = None) -> None:
        """`requests`: the serving process's request log, so that a capture setting
        applies there at once (the CLI has none: a server picks it up within seconds)."""
        self.store = store
        self.requests = requests if requests is not None else RequestLog(store)

    async def create_org(self, args: Mapping[str, Any]) -> Json:
        limits = _limits(args)
        priority = _priority({"priority": args.get("priority") or "normal"}, follow_org=False)
        org = await self.store.create_org(
            cast(str, _str(args, "name")), balance_micros=_money(args, "balance"),
            free_tier_daily_requests=_opt_int(args, "free_tier_daily_requests"),
            rpm=limits["rpm"], tpm=limits["tpm"], max_concurrency=limits["max_concurrency"],
            priority=cast(int, priority),
        )
        return org_json(org, await self.store.balance(org.id))

    async def list_orgs(self) -> list[Json]:
        return [org_json(org, await self.store.balance(org.id))
                for org in await self.store.list_orgs()]

    async def create_project(self, org_id: str, args: Mapping[str, Any]) -> Json:
        await self._org(org_id)
        project = await self.store.create_project(org_id, cast(str, _str(args, "name")))
        return {"id": project.id, "org_id": project.org_id, "name": project.name}

    async def create_key(self, args: Mapping[str, Any]) -> Json:
        """A new key; the response is the only place its secret ever appears."""
        org_id = cast(str, _str(args, "org_id"))
        await self._org(org_id)
        args = _flat_scopes(args)
        scopes = Scopes(models=_models(args),
                        max_context_tokens=_opt_int(args, "max_context_tokens"),
                        admin=flag(args, "admin", default=False))
        # Every argument is checked before the store is called: only its LookupError is
        # about the project.
        name = _str(args, "name", required=False) or "key"
        project_id = _str(args, "project_id", required=False)
        expires_at, priority, limits = (_time(args, "expires_at"),
                                        _priority(args, follow_org=True), _limits(args))
        budget, user_id = budget_arg(args), _str(args, "user_id", required=False)
        if user_id is not None:
            project_id = await self._user_project(org_id, user_id, project_id)
        try:
            secret, key = await self.store.create_api_key(
                org_id, name=name, project_id=project_id, user_id=user_id, scopes=scopes,
                expires_at=expires_at, rpm=limits["rpm"], tpm=limits["tpm"],
                max_concurrency=limits["max_concurrency"], priority=priority, budget=budget,
            )
        except LookupError as exc:  # a project of another org, or none
            raise AdminError("project_id", str(exc)) from None
        return {**key_json(key), "secret": secret}

    async def list_keys(self, org_id: str | None = None) -> list[Json]:
        return [key_json(key) for key in await self.store.list_keys(org_id)]

    async def revoke_key(self, key_id: str) -> Json:
        if not await self.store.revoke_key(key_id):
            raise NotFound("key_id", f"no active key {key_id}")
        return {"id": key_id, "revoked": True}

    async def set_key_limits(self, key_id: str, args: Mapping[str, Any]) -> Json:
        if not await self.store.set_key_limits(key_id, **_limits(args)):
            raise NotFound("key_id", f"no key {key_id}")
        return {"id": key_id, **_limits(args)}

    async def set_org_limits(self, org_id: str, args: Mapping[str, Any]) -> Json:
        limits = {**_limits(args),
                  "free_tier_daily_requests": _opt_int(args, "free_tier_daily_requests"),
                  "batch_enqueued_tokens": _opt_int(args, "batch_enqueued_tokens")}
        if not await self.store.set_org_limits(org_id, **limits):
            raise NotFound("org_id", f"no org {org_id}")
        return {"id": org_id, **limits}

    async def set_key_priority(self, key_id: str, args: Mapping[str, Any]) -> Json:
        """The key's priority class; "org" (or null) makes it follow its org's."""
        if "priority" not in args:
            raise AdminError("priority", "priority is required (\"org\": the org's)")
        priority = _priority(args, follow_org=True)
        if not await self.store.set_key_priority(key_id, priority):
            raise NotFound("key_id", f"no key {key_id}")
        return {"id": key_id, "priority": priority_name(priority) or "org"}

    async def set_org_priority(self, org_id: str, args: Mapping[str, Any]) -> Json:
        """The org's priority class, which its keys without their own follow."""
        priority = cast(int, _priority(args, follow_org=False))
        if not await self.store.set_org_priority(org_id, priority):
            raise NotFound("org_id", f"no org {org_id}")
        return {"id": org_id, "priority": priority_name(priority)}

    async def set_price(self, model: str, args: Mapping[str, Any]) -> Json:
        """Prices per million tokens, as decimal strings."""
        names = ("input", "cached_input", "output")
        micros = {name: _money(args, name) or 0 for name in names}
        await self.store.set_price(model, **micros)
        return {"model": model, **{n: format_money(v) for n, v in micros.items()}}

    async def list_prices(self) -> list[Json]:
        return [{"model": model, **{k: format_money(v) for k, v in asdict(p).items()}}
                for model, p in sorted((await self.store.prices()).items())]

    async def add_credit(self, org_id: str, args: Mapping[str, Any]) -> Json:
        await self._org(org_id)
        balance = await self.store.add_credit(org_id, cast(int, _money(args, "amount", True)))
        return {"org_id": org_id, "balance": format_money(balance)}

    async def set_spend_cap(self, org_id: str, args: Mapping[str, Any]) -> Json:
        await self._org(org_id)
        cap = _money(args, "cap")
        project = _str(args, "project_id", required=False)
        if project is not None and project not in {
                p.id for p in await self.store.list_projects(org_id)}:
            raise NotFound("project_id", f"no project {project} in org {org_id}")
        await self.store.set_spend_cap(org_id, project, cap)
        return {"org_id": org_id, "project_id": project,
                "cap": format_money(cap) if cap is not None else None}

    async def usage(self, args: Mapping[str, Any]) -> list[Json]:
        group_by = _str(args, "group_by", required=False) or "model"
        if group_by not in GROUPS:
            raise AdminError("group_by", f"group_by must be one of {', '.join(GROUPS)}")
        rows = await self.store.usage_report(
            cast(GroupBy, group_by), since=_time(args, "since"), until=_time(args, "until"),
            org_id=_str(args, "org_id", required=False),
        )
        return [usage_json(row) for row in rows]

    async def shadow_report(self, args: Mapping[str, Any]) -> list[Json]:
        """Per (alias, primary, shadow): count, text match rate, p50 latencies and their
        ratio, mean output tokens (`alias`, `since` filter)."""
        rows = await shadow_report_of(self.store, alias=_str(args, "alias", required=False),
                                      since=_time(args, "since"))
        return [asdict(row) for row in rows]

    async def set_capture(self, org_id: str, args: Mapping[str, Any]) -> Json:
        """Capture the org's request and response bodies (redacted) for `retention_days`
        (default 7), or stop (`enabled` false; captures already kept stay until they
        expire)."""
        await self._org(org_id)
        enabled = flag(args, "enabled", default=True)
        days = _opt_int(args, "retention_days")
        if days == 0:
            raise AdminError("retention_days", "retention_days must be >= 1")
        days = (days or DEFAULT_CAPTURE_DAYS) if enabled else None
        await self.requests.set_capture(org_id, days)
        return {"org_id": org_id, "capture": enabled, "retention_days": days}

    async def capture(self, org_id: str) -> Json:
        await self._org(org_id)
        days = (await capture_settings(self.store.db)).get(org_id)
        return {"org_id": org_id, "capture": days is not None, "retention_days": days}

    async def _user_project(self, org_id: str, user_id: str, project_id: str | None
                            ) -> str | None:
        """The project of a key of `user_id`: the user's own when it has one (a key of
        it may name no other), else `project_id`. A user of another org is refused."""
        user = await self.store.get_user(user_id)
        if user is None or user.org_id != org_id:
            raise AdminError("user_id", f"no user {user_id} in org {org_id}")
        if user.project_id is None or project_id in (None, user.project_id):
            return user.project_id or project_id
        raise AdminError("project_id", f"user {user_id} works in project "
                                       f"{user.project_id}, not {project_id}")

    async def _org(self, org_id: str) -> None:
        if await self.store.get_org(org_id) is None:
            raise NotFound("org_id", f"no org {org_id}")


# ---------------------------------------------------------------------------- output


def to_csv(rows: Sequence[Json]) -> str:
    """Rows as CSV with a header line (nested values as their JSON-ish text)."""
    if not rows:
        return ""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def to_table(rows: Sequence[Json]) -> str:
    """Rows as an aligned text table."""
    if not rows:
        return "(none)"
    columns = list(rows[0])
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)
