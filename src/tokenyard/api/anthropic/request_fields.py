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
- honoured too: `fallbacks` (`FallbackParam`): the models tried, in order, when `model`
  fails before the first byte of its answer (`gateway/fallbacks.py`); an entry's
  `max_tokens` and `output_config.format` apply to its attempt only, its `speed` has no
  effect and its `thinking` is refused as the request's is; "default" is the fleet
  file's fallbacks of `model`, which a request that names none gets too;
- refused: `thinking` enabled (it promises thinking blocks), server-side state and tools
  this server does not run (`container`, `mcp_servers`, `context_management`,
  `compaction`, `thread`, `fallback_credit_token`, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from tokenyard.api.errors import schema_error
from tokenyard.api.schemas import (
    Acceptable,
    Identifier,
    ModelName,
    RequestModel,
    is_none,
    none_or_empty,
)
from tokenyard.errors import UNSUPPORTED_PARAMETER
from tokenyard.fallback_spec import MAX_FALLBACKS
from tokenyard.gateway.call import Build
from tokenyard.gateway.fallbacks import Fallback


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


class FallbackParam(RequestModel):
    """One entry of `fallbacks`; any other key is refused."""

    model_config = ConfigDict(extra="forbid")
    model: ModelName
    max_tokens: int | None = Field(default=None, ge=1)
    output_config: OutputConfig | None = None
    speed: Literal["standard", "fast"] | None = None  # one speed here
    thinking: Any = None  # refused unless it asks for none, as the request's

    @field_validator("thinking")
    @classmethod
    def _check_thinking(cls, value: Any) -> Any:
        if not _thinking_ok(value):
            raise schema_error(UNSUPPORTED_PARAMETER, "fallbacks.thinking",
                               "The 'thinking' parameter is not supported by this server "
                               "yet.")
        return value

    def changes(self) -> dict[str, Any]:
        """What this entry changes in the request for its attempt (its fields)."""
        update: dict[str, Any] = {}
        if self.max_tokens is not None:
            update["max_tokens"] = self.max_tokens
        config = self.output_config
        if config is None and "output_config" in self.model_fields_set:
            update["output_config"] = update["output_format"] = None  # null: no format
        elif config is not None and "format" in config.model_fields_set:
            update["output_config"] = OutputConfig(format=config.format)
            update["output_format"] = None
        return update


def fallbacks_of(entries: list[FallbackParam] | str | None,
                 build_with: Callable[[dict[str, Any]], Build]) -> Sequence[Fallback]:
    """The candidates `fallbacks` names (none for "default": the fleet file's);
    `build_with(changes)` is the prompt work of an entry that changes the request."""
    if not isinstance(entries, list):
        return ()
    return [Fallback(e.model, f"fallbacks.{i}.model",
                     build_with(changes) if (changes := e.changes()) else None)
            for i, e in enumerate(entries)]


#: Documented fields refused unless absent or null (`thinking`: unless it asks for none).
REFUSED: dict[str, Acceptable] = {
    "thinking": _thinking_ok,
    "container": is_none,
    "mcp_servers": none_or_empty,
    "context_management": is_none,
    "compaction": is_none,
    "thread": is_none,
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
    fallbacks: list[FallbackParam] | Literal["default"] | None = Field(
        default=None, max_length=MAX_FALLBACKS)
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    inference_geo: Identifier | None = None
    diagnostics: dict[str, Any] | None = None
