"""The money side of the store: model prices, prepaid balances, spend caps, and what an
org spent (read from the ledger through `reports.py`). `Store` inherits it."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from tokenyard.store import reports
from tokenyard.store.db import Database
from tokenyard.store.ids import new_id
from tokenyard.store.money import Prices
from tokenyard.store.records import CreditState, GroupBy, SpendCap, UsageRow
from tokenyard.store.sql import insert_for
from tokenyard.store.tables import balances, model_prices, spend_caps


class Accounts:
    """Prices, balances, caps and spend over `db`; the `Store` sets the attributes."""

    db: Database
    clock: Callable[[], datetime]
    #: Counts the price changes made through this object, so that a price cache over it
    #: (billing) can read them at once rather than at its next refresh.
    prices_version: int

    # -- prices, balances, spend caps --------------------------------------------------

    async def set_price(self, model: str, *, input: int, cached_input: int, output: int) -> None:
        """Create or replace `model`'s prices, each in micros per million tokens."""
        values = {"input": input, "cached_input": cached_input, "output": output}
        insert = insert_for(self.db.dialect, model_prices).values(model=model, **values)
        query = insert.on_conflict_do_update(index_elements=["model"], set_=values)
        async with self.db.engine.begin() as conn:
            await conn.execute(query)
        self.prices_version += 1

    async def prices(self) -> dict[str, Prices]:
        """Every model's prices, by model name (micros per million tokens)."""
        async with self.db.engine.connect() as conn:
            rows = (await conn.execute(select(model_prices))).mappings()
            return {
                row["model"]: Prices(row["input"], row["cached_input"], row["output"])
                for row in rows
            }

    async def add_credit(self, org_id: str, micros: int) -> int:
        """Add `micros` (negative: a debit) to the org's prepaid balance; the new balance.

        Creates the balance row on first credit, which turns a postpaid org into a prepaid
        one. LookupError if the org does not exist.
        """
        insert = insert_for(self.db.dialect, balances).values(
            org_id=org_id, balance_micros=micros, credited_micros=micros, credit_seq=1)
        query = insert.on_conflict_do_update(
            index_elements=["org_id"],
            set_={"balance_micros": balances.c.balance_micros + insert.excluded.balance_micros,
                  "credited_micros": balances.c.credited_micros + micros,
                  "credit_seq": balances.c.credit_seq + 1},
        ).returning(balances.c.balance_micros)
        try:
            async with self.db.engine.begin() as conn:
                return int((await conn.execute(query)).scalar_one())
        except IntegrityError:
            raise LookupError(f"org {org_id} does not exist") from None

    async def balance(self, org_id: str) -> int | None:
        """The org's prepaid balance in micros, or None: postpaid (no balance row)."""
        query = select(balances.c.balance_micros).where(balances.c.org_id == org_id)
        async with self.db.engine.connect() as conn:
            value = (await conn.execute(query)).scalar_one_or_none()
        return None if value is None else int(value)

    async def credit_state(self, org_id: str) -> CreditState | None:
        """The org's prepaid balance with what admins credited to it (one row read, so the
        three agree), or None: postpaid."""
        query = select(balances.c.balance_micros, balances.c.credited_micros,
                       balances.c.credit_seq).where(balances.c.org_id == org_id)
        async with self.db.engine.connect() as conn:
            row = (await conn.execute(query)).one_or_none()
        return None if row is None else CreditState(int(row[0]), int(row[1]), int(row[2]))

    async def set_spend_cap(
        self, org_id: str, project_id: str | None, cap_micros: int | None
    ) -> None:
        """Set the monthly cap (micros, UTC calendar month) of an org (project_id None) or
        of one of its projects; `cap_micros=None` removes it."""
        same_scope = (
            spend_caps.c.project_id.is_(None)
            if project_id is None
            else spend_caps.c.project_id == project_id
        )
        # Delete first: the transaction then starts with a write (SQLite takes the write
        # lock at once) and NULL project ids need no special unique index.
        async with self.db.engine.begin() as conn:
            await conn.execute(spend_caps.delete().where(spend_caps.c.org_id == org_id, same_scope))
            if cap_micros is not None:
                await conn.execute(
                    spend_caps.insert().values(
                        id=new_id("cap"),
                        org_id=org_id,
                        project_id=project_id,
                        cap_micros=cap_micros,
                    )
                )

    async def spend_caps(self, org_id: str | None = None) -> list[SpendCap]:
        """Every spend cap (of `org_id` only, if given)."""
        query = select(spend_caps.c.org_id, spend_caps.c.project_id, spend_caps.c.cap_micros)
        if org_id is not None:
            query = query.where(spend_caps.c.org_id == org_id)
        async with self.db.engine.connect() as conn:
            return [
                SpendCap(row.org_id, row.project_id, int(row.cap_micros))
                for row in await conn.execute(query)
            ]

    # -- usage (reports.py) ------------------------------------------------------------

    async def month_spend(self, org_id: str, project_id: str | None = None) -> int:
        """Micros spent by the org (or one of its projects) this UTC calendar month."""
        return await reports.month_spend(self.db.engine, self.clock(), org_id, project_id)

    async def requests_today(self, org_id: str) -> int:
        """The org's requests today (UTC) that count against a free tier."""
        return await reports.requests_today(self.db.engine, self.clock(), org_id)

    async def usage_report(
        self,
        group_by: GroupBy,
        since: datetime | None = None,
        until: datetime | None = None,
        org_id: str | None = None,
    ) -> list[UsageRow]:
        """Ledger totals per key, project, org, model or day, for since <= t < until."""
        return await reports.usage_report(self.db.engine, group_by, since, until, org_id)
