"""Data residency in the store: the regions an org's requests may be served in, and a
project's narrower list (`orgs.allowed_regions`, `projects.allowed_regions`: a JSON list
of names, NULL for any region).

`allowed` combines the two as the gateway applies them: a project narrows its org (the
regions in both), and a project without a list follows its org. The key lookup
(`Store.find_key`) reads both lists in its one query, so the gateway's key cache carries
them and a request costs no extra round trip.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from tokenyard.store.tables import orgs, projects


def region_list(value: Any) -> tuple[str, ...] | None:
    """A stored list (JSON) as a tuple; None stays None (any region)."""
    return None if value is None else tuple(str(v) for v in value)


def allowed(org_regions: Sequence[str] | None,
            project_regions: Sequence[str] | None) -> frozenset[str] | None:
    """The regions a key of this org and project may be served in (None: any)."""
    if org_regions is None and project_regions is None:
        return None
    if org_regions is None:
        return frozenset(project_regions or ())
    if project_regions is None:
        return frozenset(org_regions)
    return frozenset(org_regions) & frozenset(project_regions)


async def set_org_regions(engine: AsyncEngine, org_id: str,
                          regions: Iterable[str] | None) -> bool:
    """Replace the org's allowed regions (None: any); False if no such org."""
    value = None if regions is None else sorted(set(regions))
    async with engine.begin() as conn:
        result = await conn.execute(
            update(orgs).where(orgs.c.id == org_id).values(allowed_regions=value))
    return result.rowcount == 1


async def set_project_regions(engine: AsyncEngine, project_id: str,
                              regions: Iterable[str] | None) -> bool:
    """Replace the project's allowed regions (None: its org's); False if no such project."""
    value = None if regions is None else sorted(set(regions))
    async with engine.begin() as conn:
        result = await conn.execute(
            update(projects).where(projects.c.id == project_id)
            .values(allowed_regions=value))
    return result.rowcount == 1


async def org_regions(engine: AsyncEngine, org_id: str) -> tuple[bool, tuple[str, ...] | None]:
    """(whether the org exists, its allowed regions)."""
    async with engine.connect() as conn:
        row = (await conn.execute(select(orgs.c.allowed_regions)
                                  .where(orgs.c.id == org_id))).first()
    return (False, None) if row is None else (True, region_list(row[0]))


async def project_regions(engine: AsyncEngine, project_id: str
                          ) -> tuple[str | None, tuple[str, ...] | None]:
    """(the project's org, None if no such project; its allowed regions)."""
    async with engine.connect() as conn:
        row = (await conn.execute(
            select(projects.c.org_id, projects.c.allowed_regions)
            .where(projects.c.id == project_id))).first()
    return (None, None) if row is None else (row[0], region_list(row[1]))
