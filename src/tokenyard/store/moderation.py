"""Moderation in the store: orgs' policies (`org_moderation`) and the audit trail of
flagged and blocked texts (`moderation_events`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, insert, select

from tokenyard.store.db import Database
from tokenyard.store.sql import utcnow
from tokenyard.store.tables import moderation_events, org_moderation


@dataclass(frozen=True)
class ModerationEvent:
    """One flagged or blocked text."""

    request_id: str
    created_at: datetime
    org_id: str | None
    deployment: str
    direction: str  # input | output
    action: str  # flag | block
    classifier: str
    categories: list[str]
    scores: dict[str, float]


async def org_policies(db: Database) -> dict[str, tuple[str, str]]:
    """Every org's policy: org id → (input, output)."""
    t = org_moderation.c
    async with db.engine.connect() as conn:
        rows = (await conn.execute(select(t.org_id, t.input, t.output))).all()
    return {row[0]: (row[1], row[2]) for row in rows}


async def set_org_policy(db: Database, org_id: str, input: str, output: str) -> None:
    """Replace the org's policy (both directions 'off' removes its row)."""
    async with db.engine.begin() as conn:
        await conn.execute(delete(org_moderation).where(org_moderation.c.org_id == org_id))
        if (input, output) != ("off", "off"):
            await conn.execute(insert(org_moderation), [{
                "org_id": org_id, "input": input, "output": output, "updated_at": utcnow()}])


async def insert_events(db: Database, events: Sequence[ModerationEvent]) -> None:
    """Write `events` in one transaction (nothing for none)."""
    if events:
        async with db.engine.begin() as conn:
            await conn.execute(insert(moderation_events), [asdict(e) for e in events])


async def list_events(
    db: Database, *, org_id: str | None = None, since: datetime | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    """The latest events first (at most `limit`), optionally of one org or since a time."""
    t = moderation_events.c
    query = select(moderation_events).order_by(t.id.desc()).limit(limit)
    if org_id is not None:
        query = query.where(t.org_id == org_id)
    if since is not None:
        query = query.where(t.created_at >= since)
    async with db.engine.connect() as conn:
        return [dict(row._mapping) for row in (await conn.execute(query)).all()]
