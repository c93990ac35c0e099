"""The one schema (DESIGN §4), as SQLAlchemy Core tables shared by SQLite and PostgreSQL.

Ids are short prefixed strings (`org_…`, `proj_…`, `key_…`); money columns are integer
micros; timestamps are UTC. `migrations/versions/` must create exactly this schema
(tests compare the two).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
)

from tokenyard.store.schema_base import (
    ID,
    LedgerId,
    UTCDateTime,
    budget_columns,
    limit_columns,
    metadata,
)

orgs = Table(
    "orgs",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("name", String(200), nullable=False),
    *limit_columns(),
    Column("free_tier_daily_requests", Integer, nullable=True),  # NULL: no free tier
    # The scheduler's class of the org's requests: lower runs first, 0 is normal.
    Column("priority", Integer, nullable=False, server_default="0"),
    Column("created_at", UTCDateTime, nullable=False),
    # The regions whose deployments may serve the org's requests (NULL: any).
    Column("allowed_regions", JSON, nullable=True),
    # The estimated tokens its batches at work may hold (NULL: the gateway's default).
    Column("batch_enqueued_tokens", BigInteger, nullable=True),
)

projects = Table(
    "projects",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("org_id", String(ID), ForeignKey("orgs.id"), nullable=False, index=True),
    Column("name", String(200), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    # Narrows its org's allowed regions (NULL: the org's).
    Column("allowed_regions", JSON, nullable=True),
)

users = Table(
    "users",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("org_id", String(ID), ForeignKey("orgs.id"), nullable=False, index=True),
    Column("email", String(320), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("name", String(200), nullable=True),
    # The project the user works in (NULL: none): its keys default to it. No foreign key
    # (0009 adds the column; the store checks that the project is the org's).
    Column("project_id", String(ID), nullable=True),
    *budget_columns(),
    Index(None, "org_id", "email", unique=True),  # an email names one user of an org
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("org_id", String(ID), ForeignKey("orgs.id"), nullable=False, index=True),
    Column("project_id", String(ID), ForeignKey("projects.id"), nullable=True),
    Column("user_id", String(ID), ForeignKey("users.id"), nullable=True),
    Column("name", String(200), nullable=False),
    Column("prefix", String(16), nullable=False),  # the visible head, e.g. "sk-ty-AbCd"
    # SHA-256 hex of the whole secret; the secret itself is never stored.
    Column("secret_hash", String(64), nullable=False, unique=True),
    Column("scopes", JSON, nullable=False),  # {"models": [...], "max_context_tokens", "admin"}
    *limit_columns(),
    Column("priority", Integer, nullable=True),  # NULL: the org's
    Column("expires_at", UTCDateTime, nullable=True),
    Column("revoked_at", UTCDateTime, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    *budget_columns(),
)

model_prices = Table(
    "model_prices",
    metadata,
    Column("model", String(200), primary_key=True),
    # Each in micros per million tokens.
    Column("input", BigInteger, nullable=False),
    Column("cached_input", BigInteger, nullable=False),
    Column("output", BigInteger, nullable=False),
)

balances = Table(
    "balances",
    metadata,
    # No row: the org is postpaid (unbounded). A row: prepaid, may go negative after the
    # last request that was admitted while it was still positive.
    Column("org_id", String(ID), ForeignKey("orgs.id"), primary_key=True),
    Column("balance_micros", BigInteger, nullable=False),
    # Every credit and debit an admin made (add_credit), summed, and how many: a gateway
    # holding money in Redis learns of a credit from them, never from the balance, which
    # the ledger's commits change too (gateway/redis_money.py).
    Column("credited_micros", BigInteger, nullable=False, server_default="0"),
    Column("credit_seq", BigInteger, nullable=False, server_default="0"),
)

spend_caps = Table(
    "spend_caps",
    metadata,
    Column("id", String(ID), primary_key=True),
    Column("org_id", String(ID), ForeignKey("orgs.id"), nullable=False),
    Column("project_id", String(ID), ForeignKey("projects.id"), nullable=True),  # NULL: org
    Column("cap_micros", BigInteger, nullable=False),  # per calendar month, UTC
    Index(None, "org_id", "project_id"),
)

usage_ledger = Table(
    "usage_ledger",
    metadata,
    Column("id", LedgerId, primary_key=True, autoincrement=True),
    # Unique so that replaying a journal after a crash never bills a request twice.
    Column("request_id", String(64), nullable=False, unique=True),
    Column("created_at", UTCDateTime, nullable=False, index=True),
    Column("day", String(10), nullable=False),  # 'YYYY-MM-DD' (UTC) of created_at
    Column("org_id", String(ID), nullable=False),
    Column("project_id", String(ID), nullable=True),
    Column("key_id", String(ID), nullable=True),
    Column("model", String(200), nullable=False),
    Column("endpoint", String(100), nullable=False),
    Column("status", String(16), nullable=False),  # completed, stopped, aborted, failed
    Column("prompt_tokens", Integer, nullable=False),  # all prompt tokens, cached included
    Column("cached_tokens", Integer, nullable=False),
    # Prompt tokens written to the prompt cache (cache_control), by how long they are kept.
    Column("cache_write_5m_tokens", Integer, nullable=False, server_default="0"),
    Column("cache_write_1h_tokens", Integer, nullable=False, server_default="0"),
    Column("output_tokens", Integer, nullable=False),
    Column("cost_micros", BigInteger, nullable=False),
    Column("user_id", String(ID), nullable=True),  # the key's user (NULL: none; 0009)
    Index(None, "key_id", "day"),  # a key's budget reads its spend by these two
    Index(None, "user_id", "day"),
    Column("region", String(64), nullable=True),  # the serving deployment's (NULL: none)
    Index(None, "org_id", "day"),
    Column("batch_id", String(40), nullable=True),  # NULL: a live request (0011)
)

idempotency_records = Table(
    "idempotency_records",
    metadata,
    # A record is the API key's, not its org's: another key of the org that sends the same
    # Idempotency-Key runs a request of its own (authorized as itself), never this replay.
    # The defaults ('') only serve gateways of before 0008 during a rolling upgrade: their
    # rows name no key and no route, so no gateway of 0008 ever replays them.
    Column("org_id", String(ID), nullable=False),
    Column("api_key_id", String(ID), nullable=False, server_default=""),
    Column("key", String(255), nullable=False),
    # What the key was first sent to ("POST /v1/chat/completions"): on another route the
    # same key is refused like another body.
    Column("route", String(100), nullable=False, server_default=""),
    Column("body_hash", String(64), nullable=False),  # SHA-256 hex of the request body
    Column("state", String(8), nullable=False),  # 'running' or 'done'
    Column("status_code", Integer, nullable=True),
    Column("headers", JSON, nullable=True),
    Column("body", LargeBinary, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("expires_at", UTCDateTime, nullable=False, index=True),
    # The primary key is what lets exactly one of two racing requests claim a key.
    PrimaryKeyConstraint("org_id", "api_key_id", "key"),
)

shadow_results = Table(
    "shadow_results",
    metadata,
    # One row per request an alias copied to its shadow deployment (never billed): the
    # pair's latencies (ms, from the request's start to its last token), output tokens
    # and whether the two texts were equal.
    Column("id", LedgerId, primary_key=True, autoincrement=True),
    Column("request_id", String(64), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("alias", String(200), nullable=False),
    Column("primary_deployment", String(200), nullable=False),
    Column("shadow_deployment", String(200), nullable=False),
    Column("primary_ms", Float, nullable=False),
    Column("shadow_ms", Float, nullable=False),
    Column("primary_output_tokens", Integer, nullable=False),
    Column("shadow_output_tokens", Integer, nullable=False),
    Column("texts_match", Boolean, nullable=False),
    Index(None, "alias", "created_at"),
)

org_moderation = Table(
    "org_moderation",
    metadata,
    # An org's moderation policy (no row: off). Each direction is 'off', 'flag' (recorded
    # in moderation_events, never delaying the request) or 'block'; the stricter of this
    # and the deployment's own policy applies.
    Column("org_id", String(ID), ForeignKey("orgs.id"), primary_key=True),
    Column("input", String(8), nullable=False),
    Column("output", String(8), nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
)

moderation_events = Table(
    "moderation_events",
    metadata,
    # One row per flagged or blocked text: which request, whose, on which deployment, in
    # which direction ('input' or 'output'), what was done ('flag' or 'block'), the
    # categories that were flagged and every category's score.
    Column("id", LedgerId, primary_key=True, autoincrement=True),
    Column("request_id", String(64), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("org_id", String(ID), nullable=True),
    Column("deployment", String(200), nullable=False),
    Column("direction", String(8), nullable=False),
    Column("action", String(8), nullable=False),
    Column("classifier", String(32), nullable=False),
    Column("categories", JSON, nullable=False),
    Column("scores", JSON, nullable=False),
    Index(None, "org_id", "created_at"),
)

#: Long enough for any response id a client may send back ("resp_" + 48 hex is OpenAI's).
RESPONSE_ID = 100

stored_responses = Table(
    "stored_responses",
    metadata,
    # One row per response `POST /v1/responses` stored: whose it is, the response it
    # continued (its chain is followed through this column), the response object as the
    # client received it, its own turn's input items, and when it stops being served.
    Column("id", String(RESPONSE_ID), primary_key=True),
    Column("org_id", String(ID), nullable=False),
    Column("project_id", String(ID), nullable=True),
    Column("key_id", String(ID), nullable=True),
    Column("previous_response_id", String(RESPONSE_ID), nullable=True),
    Column("response", JSON, nullable=False),
    Column("input_items", JSON, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("expires_at", UTCDateTime, nullable=False, index=True),
)

conversations = Table(
    "conversations",
    metadata,
    # One row per conversation of the Conversations API: whose it is, its metadata, and
    # its items in order (a response made with `conversation` appends its input and
    # output items); rows of another org are never seen.
    Column("id", String(RESPONSE_ID), primary_key=True),
    Column("org_id", String(ID), nullable=False, index=True),
    Column("project_id", String(ID), nullable=True),
    Column("key_id", String(ID), nullable=True),
    Column("metadata", JSON, nullable=False),
    Column("items", JSON, nullable=False),
    # Bumped by every change: a change writes only over the revision it read.
    Column("revision", Integer, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
)

request_records = Table(
    "request_records",
    metadata,
    # One row per finished request that reached a deployment, written in batches after
    # it ended and deleted after the serve's retention window: whose it was, where it
    # ran, how it ended, its token counts, its stage durations (ms), what it was charged.
    Column("request_id", String(64), primary_key=True),
    Column("created_at", UTCDateTime, nullable=False, index=True),
    Column("org_id", String(ID), nullable=True),
    Column("project_id", String(ID), nullable=True),
    Column("key_prefix", String(16), nullable=True),
    Column("endpoint", String(100), nullable=False),
    Column("model", String(200), nullable=True),
    Column("deployment", String(200), nullable=True),
    Column("replica", String(200), nullable=True),
    Column("status", Integer, nullable=False),  # HTTP
    Column("error_code", String(64), nullable=True),
    Column("finish_reason", String(200), nullable=True),
    Column("stream", Boolean, nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("cached_tokens", Integer, nullable=False),
    Column("output_tokens", Integer, nullable=False),
    Column("cost_micros", BigInteger, nullable=True),  # NULL: not billed
    Column("timings", JSON, nullable=False),  # stage → ms
    Column("duration_ms", Float, nullable=False),
    Column("user_id", String(ID), nullable=True),  # the key's user (NULL: none; 0009)
    Column("region", String(64), nullable=True),  # the serving deployment's (NULL: none)
    # Each candidate a request with fallbacks tried (NULL: it had none; 0015).
    Column("attempts", JSON, nullable=True),
    # Where it came from: live, batch (a Batch API line) or background (0019).
    Column("lane", String(16), nullable=False, server_default="live"),
    Index(None, "lane", "created_at"),  # the admin listing filters by lane, newest first
)

org_capture = Table(
    "org_capture",
    metadata,
    # An org whose request and response bodies are captured (no row: off), and how many
    # days each capture is kept.
    Column("org_id", String(ID), ForeignKey("orgs.id"), primary_key=True),
    Column("retention_days", Integer, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
)

request_captures = Table(
    "request_captures",
    metadata,
    # The redacted request and response bodies of a captured org's request (text: JSON
    # when whole, cut at the capture limit when `truncated`), deleted at `expires_at`.
    Column("request_id", String(64), primary_key=True),
    Column("org_id", String(ID), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("expires_at", UTCDateTime, nullable=False, index=True),
    Column("request", Text, nullable=False),
    Column("response", Text, nullable=True),
    Column("truncated", Boolean, nullable=False),
)

# The Batch API's tables live in batch_tables.py; imported here so that `metadata`
# holds the whole schema wherever tables is imported.
from tokenyard.store.batch_tables import batch_lines, batches, files  # noqa: E402

__all__ = ["ID", "UTCDateTime", "batch_lines", "batches", "files", "metadata"]
