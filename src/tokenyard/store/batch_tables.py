"""The Batch API's tables (DESIGN §4): uploaded files, batches and their lines."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Index,
    Integer,
    LargeBinary,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    false,
)

from tokenyard.store.schema_base import ID, UTCDateTime, metadata

# The Batch API (0011): uploaded files and batches' result files, per org, with their bytes.
files = Table(
    "files",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("org_id", String(ID), nullable=False),
    Column("project_id", String(ID), nullable=True),
    Column("filename", String(255), nullable=False),
    Column("purpose", String(32), nullable=False),  # batch, batch_output
    Column("bytes", BigInteger, nullable=False),
    Column("lines", Integer, nullable=False),
    Column("content", LargeBinary, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Index(None, "org_id", "created_at"),
)

batches = Table(
    "batches",
    metadata,
    # One batch, OpenAI's (`dialect` openai: lines from an input file) or Anthropic's
    # (inline requests), run under its owner key; `status` is OpenAI's vocabulary
    # (in_progress, cancelling, completed, cancelled, expired, failed).
    Column("id", String(40), primary_key=True),
    Column("dialect", String(16), nullable=False),
    Column("org_id", String(ID), nullable=False),
    Column("project_id", String(ID), nullable=True),
    Column("key_id", String(ID), nullable=False),
    Column("endpoint", String(100), nullable=False),
    Column("input_file_id", String(40), nullable=True),
    Column("completion_window", String(8), nullable=False),
    Column("metadata", JSON, nullable=True),
    Column("status", String(16), nullable=False, index=True),
    Column("total", Integer, nullable=False),
    Column("enqueued_tokens", BigInteger, nullable=False),  # estimated, for the quota
    Column("output_file_id", String(40), nullable=True),
    Column("error_file_id", String(40), nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("in_progress_at", UTCDateTime, nullable=True),
    Column("expires_at", UTCDateTime, nullable=False),
    Column("cancelling_at", UTCDateTime, nullable=True),
    Column("ended_at", UTCDateTime, nullable=True),
    Column("deleted", Boolean, nullable=False, server_default=false()),
    # Kept as lines end (0016), so a status read is one row: lines ended by how, and what
    # they used; the model its lines name.
    Column("model", String(255), nullable=True),
    Column("succeeded", Integer, nullable=False, server_default="0"),
    Column("failed", Integer, nullable=False, server_default="0"),
    Column("cancelled", Integer, nullable=False, server_default="0"),
    Column("input_tokens", BigInteger, nullable=False, server_default="0"),
    Column("cached_tokens", BigInteger, nullable=False, server_default="0"),
    Column("output_tokens", BigInteger, nullable=False, server_default="0"),
    Index(None, "org_id", "created_at"),
)

batch_lines = Table(
    "batch_lines",
    metadata,
    # One request of a batch: queued, running (claimed by a worker until `lease_until`),
    # done (its rendered result: the response body or the error body, as JSON text) or
    # aborted (cut in flight by the batch's cancel: no result).
    Column("batch_id", String(40), nullable=False),
    Column("line", Integer, nullable=False),
    Column("custom_id", String(512), nullable=False),
    Column("body", Text, nullable=False),
    Column("sort_key", String(64), nullable=False),  # lines sharing a prefix run together
    Column("state", String(8), nullable=False),
    Column("claimed_by", String(64), nullable=True),
    Column("lease_until", UTCDateTime, nullable=True),
    Column("status_code", Integer, nullable=True),
    Column("result", Text, nullable=True),
    Column("finished_at", UTCDateTime, nullable=True),
    PrimaryKeyConstraint("batch_id", "line"),
    Index(None, "batch_id", "state", "sort_key"),
)
