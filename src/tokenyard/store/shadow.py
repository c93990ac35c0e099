"""Shadow results: rows written in batches, and the per-pair report read back.

A row compares one request's answer on its primary deployment with the copy its alias
sent to a shadow deployment. The report groups rows by (alias, primary, shadow); its
medians are computed here rather than in SQL, since SQLite has no percentile function.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime

from sqlalchemy import insert, select

from tokenyard.store.db import Database
from tokenyard.store.tables import shadow_results


@dataclass(frozen=True)
class ShadowRecord:
    """One request's pair: latencies in ms (request start → last token)."""

    request_id: str
    created_at: datetime
    alias: str
    primary_deployment: str
    shadow_deployment: str
    primary_ms: float
    shadow_ms: float
    primary_output_tokens: int
    shadow_output_tokens: int
    texts_match: bool


@dataclass(frozen=True)
class ShadowReportRow:
    """One (alias, primary, shadow) pair's totals."""

    alias: str
    primary: str
    shadow: str
    count: int
    match_rate: float
    primary_p50_ms: float
    shadow_p50_ms: float
    #: shadow p50 / primary p50 (None when the primary's is 0).
    latency_ratio: float | None
    primary_mean_output_tokens: float
    shadow_mean_output_tokens: float


async def insert_shadow_results(db: Database, records: Sequence[ShadowRecord]) -> None:
    """Write `records` in one transaction (nothing for none)."""
    if not records:
        return
    async with db.engine.begin() as conn:
        await conn.execute(insert(shadow_results), [asdict(r) for r in records])


async def shadow_report(
    db: Database, *, alias: str | None = None, since: datetime | None = None,
) -> list[ShadowReportRow]:
    """Per (alias, primary, shadow): the count, the share of equal texts, each side's
    median latency and their ratio, each side's mean output tokens; sorted by name."""
    t = shadow_results.c
    query = select(t.alias, t.primary_deployment, t.shadow_deployment, t.primary_ms,
                   t.shadow_ms, t.primary_output_tokens, t.shadow_output_tokens,
                   t.texts_match)
    if alias is not None:
        query = query.where(t.alias == alias)
    if since is not None:
        query = query.where(t.created_at >= since)
    groups: dict[tuple[str, str, str], list[tuple[float, float, int, int, bool]]] = {}
    async with db.engine.connect() as conn:
        for row in (await conn.execute(query)).all():
            groups.setdefault((row[0], row[1], row[2]), []).append(
                (float(row[3]), float(row[4]), int(row[5]), int(row[6]), bool(row[7])))
    report = []
    for (name, primary, shadow), rows in sorted(groups.items()):
        p50 = statistics.median(r[0] for r in rows)
        s50 = statistics.median(r[1] for r in rows)
        report.append(ShadowReportRow(
            alias=name, primary=primary, shadow=shadow, count=len(rows),
            match_rate=sum(r[4] for r in rows) / len(rows),
            primary_p50_ms=p50, shadow_p50_ms=s50,
            latency_ratio=s50 / p50 if p50 > 0 else None,
            primary_mean_output_tokens=statistics.fmean(r[2] for r in rows),
            shadow_mean_output_tokens=statistics.fmean(r[3] for r in rows),
        ))
    return report
