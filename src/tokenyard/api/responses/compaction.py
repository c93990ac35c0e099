"""The compaction item (`POST /v1/responses/compact`): a summary of a conversation's
older turns that a later request sends back in their place.

Its `encrypted_content` carries the summary encoded, not encrypted: base64 of a small
JSON object behind a version tag. Nothing in it is hidden from the client (it is the
model's summary of what the client sent), and a forged one can say nothing the client
could not send as a message, so no server secret is needed to read it back: any gateway
of any deployment reads it. A content this server did not write is a 400 naming it.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Literal

from pydantic import Field, field_validator

from tokenyard.api.convert import random_id
from tokenyard.api.errors import schema_error
from tokenyard.api.schemas import RequestModel
from tokenyard.errors import INVALID_VALUE

#: The version tag `encrypted_content` starts with.
TAG = "tyc1."
#: How a summary opens in the prompt of a request that continues from it.
SUMMARY_HEADER = "Summary of the earlier conversation:"


def encode_summary(summary: str) -> str:
    """A compaction item's `encrypted_content` for `summary`."""
    data = json.dumps({"summary": summary}, ensure_ascii=False).encode()
    return TAG + base64.urlsafe_b64encode(data).decode()


def decode_summary(content: str) -> str:
    """The summary in `content`; ValueError if this server did not write it."""
    if not content.startswith(TAG):
        raise ValueError("not a compaction this server wrote")
    try:
        data = json.loads(base64.urlsafe_b64decode(content[len(TAG):].encode()))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise ValueError("a damaged compaction") from None
    if not isinstance(data, dict) or not isinstance(data.get("summary"), str):
        raise ValueError("a damaged compaction")
    return str(data["summary"])


def compaction_item(summary: str) -> dict[str, str]:
    """The output item of a compaction whose summary is `summary`."""
    return {"id": random_id("cmp_"), "type": "compaction",
            "encrypted_content": encode_summary(summary)}


class CompactionItem(RequestModel):
    """A compaction item sent back as input: the summary it carries stands for the turns
    it replaced (rendered as a system message, `SUMMARY_HEADER` first)."""

    type: Literal["compaction"]
    encrypted_content: str
    id: str | None = Field(default=None, max_length=100)
    created_by: str | None = Field(default=None, max_length=100)

    @field_validator("encrypted_content")
    @classmethod
    def _readable(cls, value: str) -> str:
        try:
            decode_summary(value)
        except ValueError as exc:
            raise schema_error(INVALID_VALUE, None,
                               f"'encrypted_content' is {exc}: send back the output of "
                               "this server's /v1/responses/compact.") from None
        return value

    @property
    def text(self) -> str:
        return f"{SUMMARY_HEADER}\n{decode_summary(self.encrypted_content)}"
