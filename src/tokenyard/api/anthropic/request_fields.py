"""The Anthropic API's top-level request options other than the conversation itself.

What the installed `anthropic` SDK documents for /v1/messages (`message_create_params`,
its beta variant, `message_count_tokens_params`) is either honoured, accepted without
effect, or refused with a 400 naming it; a field none of them documents is a 400 too
(`api.schemas.reject_unknown`):

- honoured: `output_config.format` (and the older beta spelling, a top-level
  `output_format`): the reply is JSON valid against the schema, forced by the same
  grammar path as OpenAI's `response_format` (`api.anthropic.convert.output_guided`);
- without effect: `output_config.effort` (the served models do no hidden reasoning, so
  there is no effort to spend), `thinking` disabled or adaptive (the model decides not
  to think), `speed`, `inference_geo`, `diagnostics`, `user_profile_id`, `workspace_id`,
  `metadata`, `service_tier`;
- refused: `thinking` enabled (it promises thinking blocks), server-side state and tools
  this server does not run (`container`, `mcp_servers`, `context_management`,
  `compaction`, `thread`, `fallbacks`, ...).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from tokenyard.api.schemas import Acceptable, Identifier, RequestModel, is_none, none_or_empty


class JSONOutputFormat(RequestModel):
    """``{"type": "json_schema", "schema": {...}}``: the JSON the reply must be."""

    model_config = ConfigDict(populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    """`output_config`: the reply's format; `effort` is accepted without effect."""

    format: JSONOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Metadata(RequestModel):
    """`metadata`: an opaque end-user id (at most 512 characters, as Anthropic allows)."""

    user_id: Identifier | None = None


def _thinking_ok(value: Any) -> bool:
    return value is None or (isinstance(value, dict)
                             and value.get("type") in ("disabled", "adaptive"))


#: Documented fields refused unless absent or null (`thinking`: unless it asks for none).
REFUSED: dict[str, Acceptable] = {
    "thinking": _thinking_ok,
    "container": is_none,
    "mcp_servers": none_or_empty,
    "context_management": is_none,
    "compaction": is_none,
    "thread": is_none,
    "fallbacks": none_or_empty,
    "fallback_credit_token": is_none,
    "billing_policy": is_none,
}


class ConversationOptions(RequestModel):
    """Options both /v1/messages and /v1/messages/count_tokens document."""

    output_config: OutputConfig | None = None
    #: The beta SDKs' earlier spelling of `output_config.format`.
    output_format: JSONOutputFormat | None = None
    speed: Literal["standard", "fast"] | None = None  # one speed here
    user_profile_id: Identifier | None = None
    workspace_id: Identifier | None = None

    @property
    def output_schema(self) -> tuple[str, dict[str, Any]] | None:
        """(the field that set it, the JSON schema) the reply must follow, or None."""
        config = self.output_config.format if self.output_config is not None else None
        if config is not None:
            return "output_config.format.schema", config.schema_
        if self.output_format is not None:
            return "output_format.schema", self.output_format.schema_
        return None


class GenerationOptions(RequestModel):
    """Options only /v1/messages documents, accepted without effect."""

    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    inference_geo: Identifier | None = None
    diagnostics: dict[str, Any] | None = None
