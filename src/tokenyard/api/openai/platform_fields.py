"""OpenAI's documented request fields that have no effect here, and the ones refused.

A client library sends whatever its API version documents: tags for OpenAI's own platform
(`user`, `metadata`, `store`, ...), hints for its caches and tiers, knobs of reasoning
models. Each is either accepted without effect (declared below, so a value of the wrong
type is still a 400) or refused with a 400 naming it when honouring it would change the
answer and this server cannot (`CHAT_UNSUPPORTED`). A field no version documents is a
400 as well (`api.schemas.reject_unknown`).

The served models do no hidden reasoning, so `reasoning_effort` is accepted at any
documented level and has no effect (as vLLM does for a model without a reasoning parser);
`usage.completion_tokens_details.reasoning_tokens` stays 0.
"""

from __future__ import annotations

from typing import Any, Literal

from tokenyard.api.schemas import Acceptable, RequestModel, is_none, none_or_empty

ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]
#: The tier every response reports: there is one here.
SERVICE_TIER: ServiceTier = "default"
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class PlatformFields(RequestModel):
    """Tags and hints for OpenAI's own platform, accepted on chat and legacy completions."""

    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: ServiceTier | None = None  # one tier here
    prompt_cache_key: str | None = None  # prefix caching here is automatic, per org
    safety_identifier: str | None = None
    store: bool | None = None  # nothing is kept for later retrieval either way


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
