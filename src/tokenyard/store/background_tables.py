"""Background responses' tables (issue 41): the work a gateway process claims under a
lease, and the events a client streams back from it. Declared on `tables.metadata`
beside the other tables (migration 0017 creates them; the package imports this module,
so the schema is whole wherever the store is used)."""

from __future__ import annotations

from sqlalchemy import JSON, Column, Index, Integer, PrimaryKeyConstraint, String, Table, Text

from tokenyard.store.tables import ID, RESPONSE_ID, UTCDateTime, metadata

background_responses = Table(
    "background_responses",
    metadata,
    # One row per response made with `background: true`: whose it is, the gateway region
    # that took it (only a gateway of that region runs it), the request's body and the
    # earlier items it continues, the response object as a client reads it now, and its
    # state: queued, running (claimed by one worker until `lease_until`), done or
    # cancelled. `attempts` counts the claims (a worker that died leaves one behind).
    Column("id", String(RESPONSE_ID), primary_key=True),
    Column("org_id", String(ID), nullable=False),
    Column("project_id", String(ID), nullable=True),
    Column("key_id", String(ID), nullable=False),
    Column("region", String(64), nullable=True),
    Column("body", Text, nullable=False),
    Column("earlier", JSON, nullable=False),
    Column("response", JSON, nullable=False),
    Column("state", String(16), nullable=False),
    Column("claimed_by", String(64), nullable=True),
    Column("lease_until", UTCDateTime, nullable=True),
    Column("attempts", Integer, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("ended_at", UTCDateTime, nullable=True),
    Column("expires_at", UTCDateTime, nullable=False, index=True),
    Index(None, "state", "created_at"),
)

background_events = Table(
    "background_events",
    metadata,
    # A background response's stream events in order (JSON), for a client that streams
    # it, or resumes its stream after event `sequence` N (`starting_after`).
    Column("response_id", String(RESPONSE_ID), nullable=False),
    Column("sequence", Integer, nullable=False),
    Column("event", JSON, nullable=False),
    PrimaryKeyConstraint("response_id", "sequence"),
)
