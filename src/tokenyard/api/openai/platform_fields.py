"""OpenAI's documented request fields that have no effect here, and the ones refused.

A client library sends whatever its API version documents: tags for OpenAI's own platform
(`user`, `metadata`, `store`, ...), hints for its caches and tiers, knobs of reasoning
models. Each is either accepted without effect (declared below, so a value of the wrong
type is still a 400) or refused with a 400 naming it when honouring it would change the
answer and this server cannot (`CHAT_UNSUPPORTED`). A field no version documents is a
400 as well (`api.schemas.reject_unknown`).

OpenRouter's `models` is honoured: the names tried, in order, when `model` fails before
the first byte of its answer (`gateway/fallbacks.py`).

The served models do no hidden reasoning, so `reasoning_effort` is accepted at any
documented level and has no effect (as vLLM does for a model without a reasoning parser);
`usage.completion_tokens_details.reasoning_tokens` stays 0.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from tokenyard.api.errors import schema_error
from tokenyard.api.schemas import (
    Acceptable,
    Identifier,
    ModelName,
    RequestModel,
    is_none,
    none_or_empty,
)
from tokenyard.errors import INVALID_VALUE
from tokenyard.fallback_spec import MAX_FALLBACKS
from tokenyard.gateway.fallbacks import Fallback

ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]
#: The tier every response reports: there is one here.
SERVICE_TIER: ServiceTier = "default"
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

#: OpenAI's bounds on `metadata`: pairs, a key's and a value's characters.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
#: Open Responses' bound on `prompt_cache_key` and `safety_identifier`.
MAX_HINT_ID_LENGTH = 64


class FallbackModels(RequestModel):
    """OpenRouter's `models`: the names tried, in order, after `model` (a name equal to
    `model`, or listed twice, is tried once)."""

    models: list[ModelName] | None = Field(default=None, max_length=MAX_FALLBACKS)

    def fallbacks(self, model: str) -> list[Fallback]:
        """The candidates after `model`, each once."""
        seen, out = {model}, []
        for i, name in enumerate(self.models or ()):
            if name not in seen:
                seen.add(name)
                out.append(Fallback(name, f"models.{i}"))
        return out


class PlatformFields(FallbackModels):
    """Tags and hints for OpenAI's own platform, accepted on chat and legacy completions
    (and responses). Each is bounded as OpenAI bounds it, `user` as Anthropic bounds its
    end-user id (OpenAI's spec gives none): a tag costs no more than it could on OpenAI.
    (Its base's `models` is OpenRouter's, and honoured.)"""

    user: Identifier | None = None
    metadata: dict[str, str] | None = None
    service_tier: ServiceTier | None = None  # one tier here
    # Prefix caching here is automatic, per org.
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_HINT_ID_LENGTH)
    safety_identifier: str | None = Field(default=None, max_length=MAX_HINT_ID_LENGTH)
    store: bool | None = None  # nothing is kept for later retrieval either way

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is not None and (
            len(metadata) > MAX_METADATA_PAIRS
            or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                   for k, v in metadata.items())
        ):
            raise schema_error(INVALID_VALUE, None,
                               f"'metadata' takes at most {MAX_METADATA_PAIRS} pairs, keys of "
                               f"at most {MAX_METADATA_KEY} characters and values of at most "
                               f"{MAX_METADATA_VALUE}.")
        return metadata


class ChatHints(RequestModel):
    """Chat-only fields that change cost or speed on OpenAI's platform, not the answer here."""

    reasoning_effort: ReasoningEffort | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    #: Predicted output: a speed-up only (the answer is the same); counted as none accepted.
    prediction: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None


#: Documented chat fields refused unless absent (or their no-op value): honouring them
#: would change the answer, and this server cannot.
CHAT_UNSUPPORTED: dict[str, Acceptable] = {
    "functions": none_or_empty,  # the deprecated spelling of `tools`
    "function_call": lambda v: v is None or v in ("none", "auto"),
    "audio": is_none,
    "modalities": lambda v: v is None or v == ["text"],
    "web_search_options": is_none,
    "moderation": is_none,  # moderation here is the deployment's and the org's policy
}
