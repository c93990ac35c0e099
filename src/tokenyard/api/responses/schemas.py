"""The body of POST /v1/responses: input items, function tools, the text format.

Validated as strictly as the chat dialect's (`api/schemas.RequestModel`): an unknown
top-level field is a 400 naming it. What this server cannot do is refused with a 400 that
names the field rather than silently dropped: hosted tools (web search, file search, code
interpreter, computer use, image generation, ...), reasoning effort (the model does
not reason), prompt templates, automatic context compaction (`context_management`) and
moderation per request. Item types other than messages, function calls, their outputs,
compaction items and MCP items are refused the same way. MCP tools run here
(`api/responses/mcp.py`).

The output objects and stream events are in `api/responses/objects.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from tokenyard.api.errors import schema_error
from tokenyard.api.images import only_from_user, source_problem
from tokenyard.api.openai.platform_fields import PlatformFields
from tokenyard.api.openai.tool_schemas import TOOL_NAME_PATTERN
from tokenyard.api.responses.compaction import CompactionItem
from tokenyard.api.responses.mcp_schemas import (
    MCP_ITEM_TAGS,
    McpApprovalRequestItem,
    McpApprovalResponseItem,
    McpCallItem,
    McpListToolsItem,
    McpTool,
)
from tokenyard.api.schemas import (
    TEXT_PART_SEPARATOR,
    Acceptable,
    Identifier,
    ModelName,
    RequestModel,
    is_none,
    none_or_empty,
    reject_unknown,
)
from tokenyard.errors import INVALID_VALUE, UNSUPPORTED_PARAMETER, UNSUPPORTED_VALUE
from tokenyard.text.content import Detail, ImagePart


def _tagged(tags: dict[str, str], other: str) -> Discriminator:
    """A discriminator on `type`: the tag of a known type (a missing type counts as
    "message"), else `other`, whose model names what it refuses. Capitalised tags stay
    out of validation errors' parameter paths (`api/errors.param_path`)."""

    def kind(data: Any) -> str:
        found = data.get("type", "message") if isinstance(data, dict) else getattr(
            data, "type", None)
        return tags.get(str(found), other)

    return Discriminator(kind)


class _Refused(RequestModel):
    """Any item, part or tool of a type this server does not support: a 400 naming it."""

    #: What the client may send instead, for the error message.
    instead: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        raise schema_error(UNSUPPORTED_VALUE, "type",
                           f"The type '{kind}' is not supported by this server; "
                           f"{cls.instead}.")


# ---------------------------------------------------------------------------- content parts


class TextPart(RequestModel):
    """``input_text`` (or, in an assistant message, ``output_text``/``refusal``)."""

    type: Literal["input_text", "output_text", "refusal"]
    text: str = ""
    refusal: str | None = None

    @property
    def content(self) -> str:
        return self.refusal if self.type == "refusal" and self.refusal is not None else self.text


class ImageInputPart(RequestModel):
    """``input_image``: an http(s) URL or a data URI in `image_url` (no uploaded files)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None

    @model_validator(mode="after")
    def _check(self) -> ImageInputPart:
        if self.file_id is not None:
            raise schema_error(UNSUPPORTED_VALUE, "file_id", "Images by 'file_id' are not "
                               "supported by this server; send 'image_url'.")
        if self.image_url is None:
            raise schema_error(INVALID_VALUE, "image_url", "An 'input_image' part needs "
                               "'image_url'.")
        problem = source_problem(self.image_url)
        if problem is not None:
            raise schema_error(INVALID_VALUE, "image_url", problem)
        return self

    @property
    def text(self) -> str:
        return ""

    def image_part(self, param: str) -> ImagePart:
        """This part as the template message's `ImagePart`, named `param`."""
        detail: Detail | None = None if self.detail == "original" else self.detail
        return ImagePart(param, str(self.image_url), detail)


class _RefusedPart(_Refused):
    instead = "send 'input_text' and 'input_image' parts"


ContentPart = Annotated[
    Annotated[TextPart, Tag("Text")] | Annotated[ImageInputPart, Tag("Image")]
    | Annotated[_RefusedPart, Tag("Refused")],
    _tagged({"input_text": "Text", "output_text": "Text", "refusal": "Text",
             "input_image": "Image"}, "Refused"),
]


def join_parts(content: str | list[ContentPart]) -> str:
    """A message's text as one string (text parts joined by TEXT_PART_SEPARATOR)."""
    if isinstance(content, str):
        return content
    return TEXT_PART_SEPARATOR.join(p.content for p in content if isinstance(p, TextPart))


# ---------------------------------------------------------------------------- input items


class MessageItem(RequestModel):
    """A message: ``{"role", "content"}`` with or without ``"type": "message"`` (an
    assistant message sent back from an earlier response carries id and status too)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    @model_validator(mode="after")
    def _check(self) -> MessageItem:
        only_from_user(self.role, self.content, "Image parts")
        return self

    @property
    def text(self) -> str:
        return join_parts(self.content)


class FunctionCallItem(RequestModel):
    """A call an earlier response made: its `arguments` as JSON text."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(RequestModel):
    """The client's result of call `call_id` (text, or a list of text parts)."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]

    @property
    def text(self) -> str:
        return join_parts(self.output)


class ReasoningItem(RequestModel):
    """A reasoning item an earlier response made, sent back with its output: accepted and
    left out of the prompt (as the reasoning models' templates drop past thinking)."""

    type: Literal["reasoning"]


class _RefusedItem(_Refused):
    instead = ("input items are messages, 'function_call', 'function_call_output', "
               "'reasoning' and 'compaction' and MCP items")


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")] | Annotated[FunctionCallItem, Tag("Call")]
    | Annotated[FunctionCallOutputItem, Tag("Output")]
    | Annotated[CompactionItem, Tag("Compaction")]
    | Annotated[ReasoningItem, Tag("Reasoning")]
    | Annotated[McpListToolsItem, Tag("McpList")] | Annotated[McpCallItem, Tag("McpCall")]
    | Annotated[McpApprovalRequestItem, Tag("McpApprovalRequest")]
    | Annotated[McpApprovalResponseItem, Tag("McpApprovalResponse")]
    | Annotated[_RefusedItem, Tag("Refused")],
    _tagged({"message": "Message", "function_call": "Call",
             "function_call_output": "Output", "compaction": "Compaction",
             "reasoning": "Reasoning", **MCP_ITEM_TAGS},
            "Refused"),
]


# ---------------------------------------------------------------------------- tools


class FunctionTool(RequestModel):
    """``{"type": "function", "name", "description", "parameters", "strict"}`` (flat, not
    nested under `function` as in chat). Calls are forced valid whatever `strict` says."""

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _HostedTool(_Refused):
    instead = "hosted tools do not run here; declare 'function' or 'mcp' tools"


ToolParam = Annotated[
    Annotated[FunctionTool, Tag("Function")] | Annotated[McpTool, Tag("Mcp")]
    | Annotated[_HostedTool, Tag("Hosted")],
    _tagged({"function": "Function", "mcp": "Mcp"}, "Hosted"),
]


class FunctionChoice(RequestModel):
    """``{"type": "function", "name": ...}``: call this function."""

    type: Literal["function"]
    name: str


# ---------------------------------------------------------------------------- text format


class TextFormat(RequestModel):
    """`text.format`: ``text``, ``json_object``, or ``json_schema`` (flat: name, schema,
    description, strict). Forced by a grammar on the replica, as chat's response_format."""

    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64,
                             pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            missing = "name" if self.name is None else "schema"
            raise schema_error(INVALID_VALUE, missing,
                               f"A 'json_schema' format needs '{missing}'.")
        return self


class TextConfig(RequestModel):
    """`text`: the output's format; `verbosity` is accepted as a hint without effect."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(RequestModel):
    """`reasoning`: only no effort is possible (a reasoning model thinks as its template
    says; its thinking comes back as a reasoning item)."""

    effort: Identifier | None = None
    summary: Identifier | None = None
    generate_summary: Identifier | None = None


class ResponsesStreamOptions(RequestModel):
    """`stream_options`: accepted without effect (no obfuscation padding is added)."""

    include_obfuscation: bool | None = None


# ---------------------------------------------------------------------------- the request


#: The `include` value that asks for the output text's logprobs.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: The most alternatives per token OpenAI allows (`top_logprobs`).
MAX_TOP_LOGPROBS = 20


def _none_or_false(value: Any) -> bool:
    return value is None or value is False


def _no_effort(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and value.get("effort") in (None, "none"))


def _only(key: str, *allowed: Any) -> Acceptable:
    """Acceptable when absent, or an object whose `key` is absent or one of `allowed`."""
    return lambda v: v is None or (isinstance(v, dict) and v.get(key) in (None, *allowed))


#: Fields OpenAI defines that this server accepts only with these values; the rest is a
#: 400 naming the field (the refused-only ones, not declared below, are otherwise ignored).
RESPONSES_UNSUPPORTED: dict[str, tuple[Acceptable, str]] = {
    "background_options": (is_none, "'background_options' is not supported by this "
                           "server."),
    "prompt": (is_none, "Prompt templates are not supported by this server."),
    "reasoning": (_no_effort, "Reasoning effort is not supported: a reasoning model here "
                  "thinks as its template says (send no 'reasoning', or effort 'none')."),
    "context_management": (none_or_empty, "'context_management' is not supported: this "
                           "server does not compact context."),
    "moderation": (is_none, "'moderation' per request is not supported: moderation here "
                   "is the deployment's and the org's policy."),
    # Standard is what the model serves anyway; the Daybreak programs change its answers.
    "access_programs": (_only("cyber", "standard"), "'access_programs' other than 'cyber': "
                        "'standard' are not offered by this server."),
    # No compression happens here, so only a request that requires it is refused.
    "image": (_only("context_compression", "auto", "disabled"), "'image' context "
              "compression is not supported by this server; send 'context_compression' "
              "'auto' or 'disabled'."),
    # The cache options are hints (as on chat), but a prewarm asks for no output at all.
    "prompt_cache_options": (_only("prewarm", False), "'prompt_cache_options' with "
                             "'prewarm' is not supported: prefix caching here is automatic."),
}


class ResponsesRequest(PlatformFields):
    """POST /v1/responses (`store`, unlike on chat, keeps the response for
    `previous_response_id`; the other platform fields have no effect)."""

    model: ModelName
    input: str | list[InputItem] = Field(default="")
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    #: Open Responses' penalties (not OpenAI's Responses API): applied as on chat.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    previous_response_id: Identifier | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    #: "message.output_text.logprobs" asks for the text's logprobs; the other values
    #: (hosted tools' outputs, reasoning) have nothing to include here.
    include: list[Identifier] | None = None
    reasoning: Reasoning | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    #: The most function calls the response may make (`ToolUse.max_calls`): once made,
    #: the tool grammar lets the reply only end.
    max_tool_calls: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, (ok, message) in RESPONSES_UNSUPPORTED.items():
                if name in data and not ok(data[name]):
                    raise schema_error(UNSUPPORTED_PARAMETER, name, message)
        reject_unknown(data, [*cls.model_fields, *RESPONSES_UNSUPPORTED])
        return data

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.input in ("", []) and self.previous_response_id is None:
            raise schema_error(INVALID_VALUE, "input", "'input' must not be empty.")
        names = [t.name for t in self.tools or () if isinstance(t, FunctionTool)]
        choice = self.tool_choice
        servers = any(isinstance(t, McpTool) for t in self.tools or ())
        if not names and not servers and choice not in (None, "none", "auto"):
            raise schema_error(INVALID_VALUE, "tool_choice",
                               "'tool_choice' is only allowed when 'tools' are specified.")
        if isinstance(choice, FunctionChoice) and choice.name not in names:
            raise schema_error(INVALID_VALUE, "tool_choice",
                               f"'tool_choice' names the function '{choice.name}', which is "
                               "not among 'tools'.")
        if len(set(names)) != len(names):
            raise schema_error(INVALID_VALUE, "tools",
                               "Function names in 'tools' must be unique.")
        return self

    @property
    def logprobs(self) -> int | None:
        """How many alternatives each token's logprob comes with, or None for no logprobs
        (asked for by `include` or by `top_logprobs` above 0)."""
        if LOGPROBS_INCLUDE in (self.include or ()) or self.top_logprobs:
            return self.top_logprobs or 0
        return None

    @property
    def text_format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None
