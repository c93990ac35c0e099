"""What both dialects' request schemas share: the strict base model and how a message's
text parts are joined into the chat template's single string."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

#: How several text parts of one message are joined into the template's single string.
TEXT_PART_SEPARATOR = "\n"


class RequestModel(BaseModel):
    """Base of every request body: strict types, finite numbers, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
