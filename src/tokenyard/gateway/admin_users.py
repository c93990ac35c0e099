"""Administration of users and spend budgets, beside `admin.py`'s orgs, projects and keys.

A user belongs to one org (and may work in one of its projects, which its keys then
default to); a key is tied to a user with `user_id` when it is created (`Admin.create_key`).
A key and a user may each have a budget: `monthly_budget` (per UTC calendar month) and
`total_budget` (all time), decimal strings like every amount here; null removes one.
A budget set here applies to the gateway's next admission of the key or user, at most the
key cache's TTL (1 s by default) later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from tokenyard.gateway.admin import Admin, AdminError, Json, NotFound, budget_arg, budget_json
from tokenyard.store.money import format_money
from tokenyard.store.records import Budget, UserRecord
from tokenyard.store.users import Subject

SUBJECTS: tuple[Subject, ...] = ("key", "user")


def user_json(user: UserRecord) -> Json:
    return {"id": user.id, "org_id": user.org_id, "project_id": user.project_id,
            "email": user.email, "name": user.name, **budget_json(user.budget),
            "created_at": user.created_at.isoformat()}


def _email(args: Mapping[str, Any]) -> str:
    value = args.get("email")
    if not isinstance(value, str) or "@" not in value.strip() or len(value) > 320:
        raise AdminError("email", "email is required: an address such as ada@example.com")
    return value.strip()


async def create_user(admin: Admin, args: Mapping[str, Any]) -> Json:
    """A user of `org_id` (`email`; `name`, `project_id`, budgets optional)."""
    org_id = args.get("org_id")
    if not isinstance(org_id, str) or not org_id:
        raise AdminError("org_id", "org_id is required")
    if await admin.store.get_org(org_id) is None:
        raise NotFound("org_id", f"no org {org_id}")
    name, project_id = args.get("name"), args.get("project_id")
    for field, value in (("name", name), ("project_id", project_id)):
        if value is not None and not isinstance(value, str):
            raise AdminError(field, f"{field} must be a string")
    email, budget = _email(args), budget_arg(args)
    try:
        user = await admin.store.create_user(
            org_id, email, name=cast(str | None, name) or None,
            project_id=cast(str | None, project_id) or None, budget=budget)
    except LookupError as exc:  # a project of another org, or none
        raise AdminError("project_id", str(exc)) from None
    except ValueError as exc:  # the email is taken in the org
        raise AdminError("email", str(exc)) from None
    return user_json(user)


async def list_users(admin: Admin, org_id: str | None = None) -> list[Json]:
    return [user_json(user) for user in await admin.store.list_users(org_id)]


async def set_budget(admin: Admin, subject: Subject, subject_id: str,
                     args: Mapping[str, Any]) -> Json:
    """Replace the budget of a key or a user: both caps, each absent or null for none."""
    budget = budget_arg(args)
    if not await admin.store.set_budget(subject, subject_id, budget):
        raise NotFound(f"{subject}_id", f"no {subject} {subject_id}")
    return {"subject": subject, "id": subject_id, **budget_json(budget)}


async def budgets(admin: Admin, org_id: str | None = None) -> list[Json]:
    """Every key and user with a budget (of `org_id`, if given) and what it spent, read
    from the ledger: this month (UTC) and in all."""
    found: list[tuple[Subject, str, str, Budget]] = [
        ("key", key.id, key.org_id, key.budget)
        for key in await admin.store.list_keys(org_id) if key.budget]
    found += [("user", user.id, user.org_id, user.budget)
              for user in await admin.store.list_users(org_id) if user.budget]
    rows = []
    for subject, subject_id, owner, budget in found:
        month, total = await admin.store.spend_of(subject, subject_id)
        rows.append({"subject": subject, "id": subject_id, "org_id": owner,
                     **budget_json(budget), "month_spent": format_money(month),
                     "total_spent": format_money(total)})
    return rows
