"""Reads of the usage ledger: monthly spend, daily request counts, grouped reports.

Reports filter on the `day` column ('YYYY-MM-DD', UTC), which is the same text on every
backend, so month and day boundaries need no date functions that differ between them.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from sqlalchemy import and_, case, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tokenyard.store.records import GroupBy, UsageRow
from tokenyard.store.tables import usage_ledger

GROUP_COLUMNS: dict[str, Any] = {
    "key": usage_ledger.c.key_id,
    "user": usage_ledger.c.user_id,
    "project": usage_ledger.c.project_id,
    "org": usage_ledger.c.org_id,
    "model": usage_ledger.c.model,
    "day": usage_ledger.c.day,
    "region": usage_ledger.c.region,
    "batch": usage_ledger.c.batch_id,  # NULL: live requests
}


def month_bounds(now: datetime) -> tuple[str, str]:
    """First day of `now`'s month and of the next one, as 'YYYY-MM-DD' (end exclusive)."""
    start = date(now.year, now.month, 1)
    end = date(now.year + 1, 1, 1) if now.month == 12 else date(now.year, now.month + 1, 1)
    return start.isoformat(), end.isoformat()


async def month_spend(
    engine: AsyncEngine, now: datetime, org_id: str, project_id: str | None = None
) -> int:
    """Micros the org (or the project) spent in `now`'s UTC calendar month."""
    start, end = month_bounds(now)
    query = select(func.coalesce(func.sum(usage_ledger.c.cost_micros), 0)).where(
        usage_ledger.c.org_id == org_id, usage_ledger.c.day >= start, usage_ledger.c.day < end
    )
    if project_id is not None:
        query = query.where(usage_ledger.c.project_id == project_id)
    async with engine.connect() as conn:
        # int(): PostgreSQL sums BIGINT as NUMERIC, which arrives as a Decimal.
        return int((await conn.execute(query)).scalar_one())


async def subject_spend(
    engine: AsyncEngine, now: datetime, subject: str, subject_id: str
) -> tuple[int, int]:
    """Micros a key or a user (`subject`) spent: (in `now`'s UTC calendar month, in all),
    by one query over the ledger's (key_id, day) or (user_id, day) index."""
    start, end = month_bounds(now)
    column = GROUP_COLUMNS[subject]
    cost, day = usage_ledger.c.cost_micros, usage_ledger.c.day
    query = select(
        func.coalesce(func.sum(case((and_(day >= start, day < end), cost), else_=0)), 0),
        func.coalesce(func.sum(cost), 0),
    ).where(column == subject_id)
    async with engine.connect() as conn:
        month, total = (await conn.execute(query)).one()
    return int(month), int(total)


async def requests_today(engine: AsyncEngine, now: datetime, org_id: str) -> int:
    """The org's ledger rows dated `now`'s UTC day, except 'failed' ones.

    Failed requests are the platform's fault and do not use up a free-tier allowance.
    Counts only what the ledger writer has flushed (it lags by its flush interval).
    """
    query = select(func.count()).where(
        usage_ledger.c.org_id == org_id,
        usage_ledger.c.day == now.date().isoformat(),
        usage_ledger.c.status != "failed",
    )
    async with engine.connect() as conn:
        return int((await conn.execute(query)).scalar_one())


async def usage_report(
    engine: AsyncEngine,
    group_by: GroupBy,
    since: datetime | None = None,
    until: datetime | None = None,
    org_id: str | None = None,
) -> list[UsageRow]:
    """Requests, token and cost (micros) totals per group, for since <= created_at < until."""
    if group_by not in GROUP_COLUMNS:
        raise ValueError(f"group_by must be one of {sorted(GROUP_COLUMNS)}, not {group_by!r}")
    group = GROUP_COLUMNS[group_by]
    ledger = usage_ledger.c
    query = select(
        group.label("group"),
        func.count().label("requests"),
        *(
            func.coalesce(func.sum(column), 0).label(column.name)
            for column in (
                ledger.prompt_tokens,
                ledger.cached_tokens,
                ledger.output_tokens,
                ledger.cost_micros,
            )
        ),
    ).group_by(group)
    if since is not None:
        query = query.where(ledger.created_at >= since)
    if until is not None:
        query = query.where(ledger.created_at < until)
    if org_id is not None:
        query = query.where(ledger.org_id == org_id)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).mappings().all()
    report = [
        UsageRow(
            group=row["group"],
            requests=int(row["requests"]),
            prompt_tokens=int(row["prompt_tokens"]),
            cached_tokens=int(row["cached_tokens"]),
            output_tokens=int(row["output_tokens"]),
            cost_micros=int(row["cost_micros"]),
        )
        for row in rows
    ]
    # Sorted in Python: NULL groups sort differently on the two backends.
    return sorted(report, key=lambda row: (row.group is not None, row.group or ""))
