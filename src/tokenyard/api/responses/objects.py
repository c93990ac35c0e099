"""What POST /v1/responses answers: the response object, its output items, and the
semantic events of its stream — with the field names and nesting of OpenAI's, so the
official SDK's `Response` and event models parse them (`openai/types/responses/`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from tokenyard.api.convert import random_id
from tokenyard.api.openai.schemas import TokenLogprob

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_response_id() -> str:
    """An id for a response ("resp_…")."""
    return random_id("resp_")


def new_message_id() -> str:
    """An id for an output message ("msg_…")."""
    return random_id("msg_")


def new_function_call_id() -> str:
    """An id for a function_call output item ("fc_…"; its `call_id` is "call_…")."""
    return random_id("fc_")


class OutputText(BaseModel):
    """A message's text part: no annotations here (no hosted tools cite anything); its
    tokens' logprobs when the request asked for them (chat's shape: token, logprob, bytes,
    top_logprobs)."""

    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class OutputMessage(BaseModel):
    """An assistant message item of `output`."""

    id: str = Field(default_factory=new_message_id)
    type: Literal["message"] = "message"
    status: ItemStatus = "in_progress"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallOutput(BaseModel):
    """A function_call item of `output`: the client runs it and answers with a
    `function_call_output` item naming `call_id`."""

    id: str = Field(default_factory=new_function_call_id)
    type: Literal["function_call"] = "function_call"
    status: ItemStatus = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


class McpListToolsOutput(BaseModel):
    """An mcp_list_tools item: the tools a server offers this response (`error` when it
    could not be listed)."""

    id: str = Field(default_factory=lambda: random_id("mcpl_"))
    type: Literal["mcp_list_tools"] = "mcp_list_tools"
    server_label: str
    tools: list[dict[str, Any]] = Field(default_factory=list)
    error: str | None = None
    status: ItemStatus = Field(default="completed", exclude=True)  # not OpenAI's


class McpCallOutput(BaseModel):
    """An mcp_call item: a call the platform ran on an MCP server, with its `output`, or
    its `error` (OpenAI's error objects: the tool's own error, or a protocol failure)."""

    id: str = Field(default_factory=lambda: random_id("mcp_"))
    type: Literal["mcp_call"] = "mcp_call"
    status: Literal["in_progress", "completed", "incomplete", "calling", "failed"] = \
        "in_progress"
    server_label: str
    name: str
    arguments: str = ""
    output: str | None = None
    error: dict[str, Any] | None = None
    approval_request_id: str | None = None


class McpApprovalRequestOutput(BaseModel):
    """An mcp_approval_request item: a call that waits for the client's approval (an
    `mcp_approval_response` input item naming its id)."""

    id: str = Field(default_factory=lambda: random_id("mcpr_"))
    type: Literal["mcp_approval_request"] = "mcp_approval_request"
    server_label: str
    name: str
    arguments: str = ""
    status: ItemStatus = Field(default="in_progress", exclude=True)  # not OpenAI's


class ReasoningText(BaseModel):
    """A reasoning item's text part (Open Responses' `reasoning_text`)."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningOutput(BaseModel):
    """A reasoning item of `output`: a reasoning model's thinking (its `<think>` block,
    split out by the deployment's reasoning parser), whole in `content`; no `summary` is
    made (no model here summarizes)."""

    id: str = Field(default_factory=lambda: random_id("rs_"))
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus = "in_progress"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


McpItem = McpListToolsOutput | McpCallOutput | McpApprovalRequestOutput
OutputItem = ReasoningOutput | OutputMessage | FunctionCallOutput | McpItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """`usage`: `input_tokens` includes the cached ones."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


def response_usage(input_tokens: int, output_tokens: int, cached_tokens: int,
                   reasoning_tokens: int = 0) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=input_tokens, input_tokens_details=InputTokensDetails(
            cached_tokens=cached_tokens),
        output_tokens=output_tokens, total_tokens=input_tokens + output_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
    )


class ResponseError(BaseModel):
    """`error` of a failed response."""

    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    """The response object: the whole non-streamed body, and the `response` of the
    lifecycle events (created, in_progress, completed, incomplete, failed). Everything
    but the output and the outcome echoes the request (`convert.response_shell`)."""

    id: str = Field(default_factory=new_response_id)
    object: Literal["response"] = "response"
    created_at: int
    #: queued and cancelled: a background response's (`background: true`).
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed",
                    "cancelled"] = "in_progress"
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float
    top_p: float
    #: Open Responses' penalties, as applied (0 when the request set none).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any]
    reasoning: dict[str, Any] = Field(
        default_factory=lambda: {"effort": None, "summary": None})
    metadata: dict[str, str] = Field(default_factory=dict)
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    truncation: Literal["auto", "disabled"] = "disabled"
    service_tier: str = "default"
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None


# ---------------------------------------------------------------------------- stream events


class Event(BaseModel):
    """One event of a streamed response; its SSE event name is its `type`, and
    `sequence_number` counts the stream's events from 0."""

    type: str
    sequence_number: int


class ResponseEvent(Event):
    """response.created / queued / in_progress / completed / incomplete / failed."""

    response: ResponseObject


class ItemEvent(Event):
    """response.output_item.added / done."""

    output_index: int
    item: OutputItem


class _ItemPart(Event):
    """An event about output item `item_id` (at `output_index`)."""

    item_id: str
    output_index: int


class _ContentPart(_ItemPart):
    """An event about a message item's content part `content_index` (always 0 here)."""

    content_index: int = 0


class PartEvent(_ContentPart):
    """response.content_part.added / done."""

    part: OutputText | ReasoningText


class TextDeltaEvent(_ContentPart):
    """response.output_text.delta."""

    delta: str
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class TextDoneEvent(_ContentPart):
    """response.output_text.done: the part's whole text."""

    text: str
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class ReasoningDeltaEvent(_ContentPart):
    """response.reasoning.delta: more of a reasoning item's text."""

    delta: str


class ReasoningDoneEvent(_ContentPart):
    """response.reasoning.done: a reasoning item's whole text."""

    text: str


class ArgumentsDeltaEvent(_ItemPart):
    """response.function_call_arguments.delta."""

    delta: str


class ArgumentsDoneEvent(_ItemPart):
    """response.function_call_arguments.done: the call's whole arguments."""

    arguments: str


class ItemStatusEvent(_ItemPart):
    """response.mcp_list_tools.in_progress / completed / failed and
    response.mcp_call.in_progress / completed / failed: an MCP item's progress."""
