"""OpenAI's structured-output models: the function tools a request offers (`tools`,
`tool_choice`, past `tool_calls`), the calls a reply makes (whole or as stream deltas),
the formats (`response_format`) its text must take.

Requests are validated as strictly as in `api.openai.schemas`, whose bodies use these.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from tokenyard.api.schemas import RequestModel

# ---------------------------------------------------------------------------- tools

#: A function's name, as OpenAI allows it.
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(RequestModel):
    """`tools[].function`: a name, what it does, its arguments' JSON schema."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(RequestModel):
    """One of `tools`: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    """`tool_choice.function`: the function that must be called."""

    name: str


class NamedToolChoice(RequestModel):
    """``{"type": "function", "function": {"name": ...}}``: call this function."""

    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(RequestModel):
    """A past call's function and its arguments (JSON text)."""

    name: str
    arguments: str


class ToolCallParam(RequestModel):
    """One of an assistant message's `tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


# ---------------------------------------------------------------------------- response_format


class JSONSchemaFormat(RequestModel):
    """``response_format.json_schema``: the schema the output must validate against."""

    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # constrained either way: the output always validates


class ResponseFormatText(RequestModel):
    type: Literal["text"]


class ResponseFormatJSONObject(RequestModel):
    type: Literal["json_object"]


class ResponseFormatJSONSchema(RequestModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
    Field(discriminator="type"),
]


# ---------------------------------------------------------------------------- calls in replies


class FunctionCall(BaseModel):
    """A call's function: its name and arguments (JSON text)."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One of `message.tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(BaseModel):
    """A fragment of call `index`: the first carries id, type and function name, the
    rest only `function.arguments` pieces (the SDK concatenates them)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str]

    @model_serializer(mode="plain")
    def _serialize(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
        if self.type is not None:
            out["type"] = self.type
        out["function"] = self.function
        return out
