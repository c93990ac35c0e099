"""The users of an org and the spend budgets of keys and users (0009). `Store` inherits it.

A user belongs to one org, and may work in one of its projects (its keys default to it).
A budget caps what a key or a user spends per UTC calendar month and in all, in micros;
the gateway checks it at admission (`gateway/budgets.py`) against the spend read here.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from tokenyard.store import reports
from tokenyard.store.db import Database
from tokenyard.store.ids import new_id
from tokenyard.store.records import Budget, UserRecord
from tokenyard.store.tables import api_keys, projects, users

#: Who a budget is of.
Subject = Literal["key", "user"]
_TABLES = {"key": api_keys, "user": users}


class Users:
    """Users and budgets over `db`; the `Store` sets the attributes."""

    db: Database
    clock: Callable[[], datetime]

    async def create_user(
        self, org_id: str, email: str, *, name: str | None = None,
        project_id: str | None = None, budget: Budget = Budget(),  # noqa: B008 (frozen)
    ) -> UserRecord:
        """A new user of `org_id`, working in `project_id` (one of the org's) if given.
        LookupError if the org or the project does not exist or the project is another
        org's; ValueError if the org already has a user with this email."""
        if project_id is not None:
            async with self.db.engine.connect() as conn:
                owner = (await conn.execute(select(projects.c.org_id).where(
                    projects.c.id == project_id))).scalar_one_or_none()
            if owner != org_id:
                raise LookupError(f"project {project_id} is not in org {org_id}")
        user = UserRecord(new_id("user"), org_id, email, self.clock(), name, project_id,
                          budget)
        row = {"id": user.id, "org_id": org_id, "email": email, "name": name,
               "project_id": project_id, "created_at": user.created_at,
               **_budget_values(budget)}
        try:
            async with self.db.engine.begin() as conn:
                await conn.execute(users.insert().values(row))
        except IntegrityError:
            # The org's foreign key or the (org, email) unique index.
            async with self.db.engine.connect() as conn:
                taken = (await conn.execute(select(users.c.id).where(
                    users.c.org_id == org_id, users.c.email == email))).first()
            if taken is not None:
                raise ValueError(f"org {org_id} already has a user {email}") from None
            raise LookupError(f"org {org_id} does not exist") from None
        return user

    async def get_user(self, user_id: str) -> UserRecord | None:
        """The user with id `user_id`, or None."""
        async with self.db.engine.connect() as conn:
            row = (await conn.execute(select(users).where(users.c.id == user_id))
                   ).mappings().first()
        return _user(row) if row is not None else None

    async def list_users(self, org_id: str | None = None) -> list[UserRecord]:
        """The users of `org_id` (or of every org), oldest first."""
        query = select(users).order_by(users.c.created_at, users.c.id)
        if org_id is not None:
            query = query.where(users.c.org_id == org_id)
        async with self.db.engine.connect() as conn:
            return [_user(row) for row in (await conn.execute(query)).mappings()]

    async def set_budget(self, subject: Subject, subject_id: str, budget: Budget) -> bool:
        """Replace the budget of a key or a user (`Budget()`: none); False if no such one."""
        table = _TABLES[subject]
        query = update(table).where(table.c.id == subject_id).values(_budget_values(budget))
        async with self.db.engine.begin() as conn:
            return (await conn.execute(query)).rowcount == 1

    async def spend_of(self, subject: Subject, subject_id: str) -> tuple[int, int]:
        """Micros the key or user spent (this UTC calendar month, in all), from the ledger."""
        return await reports.subject_spend(self.db.engine, self.clock(), subject, subject_id)


def _budget_values(budget: Budget) -> dict[str, int | None]:
    return {"monthly_budget_micros": budget.monthly_micros,
            "total_budget_micros": budget.total_micros}


def budget_of(row: Any, prefix: str = "") -> Budget:
    """The budget in a row's budget columns (`prefix`: how the query labelled them)."""
    return Budget(row.get(f"{prefix}monthly_budget_micros"),
                  row.get(f"{prefix}total_budget_micros"))


def _user(row: Any) -> UserRecord:
    return UserRecord(id=row["id"], org_id=row["org_id"], email=row["email"],
                      created_at=row["created_at"], name=row["name"],
                      project_id=row["project_id"], budget=budget_of(row))
