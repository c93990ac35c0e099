"""The Responses dialect's conversions: input items in, the response object out.

Inbound, the items of a conversation (earlier turns expanded from
`previous_response_id` first, then this request's) become the chat template's messages:
`instructions` and system/developer messages the system prompt; an assistant message
and the function calls after it one assistant turn; consecutive function call outputs
one turn of results; the tools are rendered as chat's are (`text/tools.py`). `text.format`
becomes the same grammar as chat's `response_format`. `truncation: "auto"` drops the
oldest items of a conversation over the context window.

Outbound, a finished reply's text splits into a message item and function_call items,
and the response object echoes the request's settings around them.

No I/O, no torch: the HTTP process calls these on its event loop.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from tokenyard.api.convert import sampling_params
from tokenyard.api.errors import from_validation_error
from tokenyard.api.images import template_message
from tokenyard.api.openai.schemas import TokenLogprob
from tokenyard.api.openai.tools import new_call_id
from tokenyard.api.responses.compaction import CompactionItem
from tokenyard.api.responses.mcp_schemas import McpApprovalRequestItem, McpCallItem, McpTool
from tokenyard.api.responses.objects import (
    FunctionCallOutput,
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseUsage,
)
from tokenyard.api.responses.schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    InputItem,
    MessageItem,
    ResponsesRequest,
)
from tokenyard.errors import INVALID_VALUE, APIError, invalid_request
from tokenyard.sampling_defaults import NONE, SamplingDefaults
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.content import TemplateMessage
from tokenyard.text.prepare import Preparer
from tokenyard.text.tool_calls import ParsedCall, split_tool_calls
from tokenyard.text.tools import (
    PastCall,
    Tool,
    ToolChoice,
    ToolResult,
    ToolUse,
    assistant_turn,
    result_turns,
    template_tools,
    with_tools,
)
from tokenyard.wire.sampling_params import GuidedDecoding, SamplingParams, SamplingParamsError

_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])
#: The engine's finish reasons that leave a response "incomplete" (out of tokens, filtered).
INCOMPLETE_REASONS = ("length", "content_filter")
#: The error code of a prompt over the context window (`errors.context_length_exceeded`).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


# ---------------------------------------------------------------------------- items in


def request_items(req: ResponsesRequest) -> list[InputItem]:
    """This request's input as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)] if req.input else []
    return list(req.input)


def items_json(items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """Items as JSON data, as a later request may send them back (what storage keeps)."""
    return [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in items]


def parse_items(data: Sequence[Any]) -> list[InputItem]:
    """Items from JSON data (earlier turns read back from storage); a 400 naming the item
    when one cannot be read back (storage holds what this module wrote)."""
    try:
        return _ITEMS.validate_python(list(data))
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def first_user_text(items: Sequence[InputItem]) -> str | None:
    """The first user message's text (what a conversation's canary draw sticks to)."""
    return next((i.text for i in items if isinstance(i, MessageItem) and i.role == "user"),
                None)


def item_messages(items: Sequence[InputItem], instructions: str | None, use: ToolUse | None,
                  native: bool = False, first_index: int = 0) -> list[TemplateMessage]:
    """The template messages of a conversation's `items` (`native`: the template renders
    tools; else calls and results are written into the turns, `text/tools.py`).
    `first_index`: the position of `items[0]` in the request's `input`, for the parameter
    paths of image errors (earlier turns count from minus their number)."""
    names: dict[str, str] = {i.call_id: i.name for i in items
                             if isinstance(i, FunctionCallItem)}
    out: list[TemplateMessage] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    calls: list[PastCall] = []  # function calls since the last assistant message
    results: list[ToolResult] = []  # consecutive function call outputs

    def flush() -> None:
        if calls:
            if out and out[-1]["role"] == "assistant":
                out.append(assistant_turn(out.pop(), calls, native))
            else:
                out.append(assistant_turn({"role": "assistant", "content": ""}, calls, native))
            calls.clear()
        if results:
            out.extend(result_turns(results, native))
            results.clear()

    answered = {i.approval_request_id for i in items if isinstance(i, McpCallItem)}
    for position, item in enumerate(items, start=first_index):
        if isinstance(item, FunctionCallItem | McpCallItem | McpApprovalRequestItem):
            if results:
                flush()
            if not (isinstance(item, McpApprovalRequestItem) and item.id in answered):
                calls.append(PastCall(item.name, item.arguments))
        if isinstance(item, FunctionCallOutputItem | McpCallItem):
            if calls:
                flush()
            if isinstance(item, McpCallItem):
                results.append(ToolResult(*item.result_of))
            else:
                results.append(ToolResult(item.text, names.get(item.call_id)))
        elif isinstance(item, MessageItem):
            flush()
            role = "system" if item.role == "developer" else item.role
            out.append(template_message(role, item.text, item.content, f"input.{position}"))
        elif isinstance(item, CompactionItem):  # the summary of the turns it replaced
            flush()
            out.append({"role": "system", "content": item.text})
    flush()
    return with_tools(out, use, native)


def fitted_conversation(
    prepare: Preparer, items: Sequence[InputItem], params: SamplingParams, *,
    instructions: str | None, use: ToolUse | None, native: bool, truncate: bool,
    first_index: int, param: str, timeline: Timeline,
) -> tuple[list[TemplateMessage], list[int], SamplingParams]:
    """The conversation's template messages, its prompt's token ids and `params` fitted
    into the context window (`text/prepare.py`). With `truncate` (``truncation: "auto"``)
    a conversation over the window loses its oldest items, one at a time, until it fits
    (the instructions stay, and at least the last item); else it is the window's 400,
    naming `param`."""
    start = 0
    while True:
        messages = item_messages(items[start:], instructions, use, native,
                                 first_index + start)
        prompt = prepare.conversation(messages, timeline, prefill=False,
                                      tools=template_tools(use, native))
        try:
            return messages, prompt, prepare.fit(len(prompt), params, param)
        except APIError as exc:
            if not truncate or exc.code != CONTEXT_LENGTH_EXCEEDED or start + 1 >= len(items):
                raise
            start += 1


def tool_use(req: ResponsesRequest, extra: tuple[Tool, ...] = ()) -> ToolUse | None:
    """The request's function tools (then `extra`: its MCP servers' tools) and choice, or
    None when it has none."""
    functions = [t for t in req.tools or () if isinstance(t, FunctionTool)]
    tools = tuple(Tool(t.name, t.description,
                       t.parameters or {"type": "object", "properties": {}},
                       t.strict is not False)
                  for t in functions) + extra
    if not tools:
        return None
    parallel = req.parallel_tool_calls is not False
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        return ToolUse(tools, ToolChoice("required", choice.name, parallel),
                       max_calls=req.max_tool_calls)
    return ToolUse(tools, ToolChoice(choice or "auto", None, parallel),
                   max_calls=req.max_tool_calls)


def text_grammar(req: ResponsesRequest) -> GuidedDecoding | None:
    """The grammar `text.format` asks for: any JSON object, or the schema's documents
    (forced whether `strict` or not); an invalid schema is found by the replica, which
    answers 400 naming ``text.format.schema``."""
    fmt = req.text_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.schema_ is None:
        return GuidedDecoding("json_object", "", param="text.format")
    try:
        return GuidedDecoding("json_schema", json.dumps(fmt.schema_), param="text.format.schema")
    except SamplingParamsError as exc:
        raise invalid_request(str(exc), param=exc.param, code=INVALID_VALUE) from None


#: The sampling parameters a Responses request has (and its response object echoes).
RESPONSES_SAMPLING = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


def sampling_values(req: ResponsesRequest, defaults: SamplingDefaults) -> dict[str, float]:
    """The request's sampling parameters, the deployment's `defaults` where it sets none."""
    return {name: defaults.value(name, getattr(req, name)) for name in RESPONSES_SAMPLING}


def request_params(req: ResponsesRequest, defaults: SamplingDefaults = NONE) -> SamplingParams:
    """The sampling parameters (`max_tokens` None: the caller fills in what the context
    window leaves; `defaults`: the deployment's, for what the request leaves out)."""
    return sampling_params(
        {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"},
        **sampling_values(req, defaults),
        max_tokens=req.max_output_tokens,
        logprobs=req.logprobs,
        guided=text_grammar(req),
    )


# ---------------------------------------------------------------------------- the response out


def response_shell(req: ResponsesRequest, model: str,
                   defaults: SamplingDefaults = NONE) -> ResponseObject:
    """The response object before any output: the request's settings echoed, as OpenAI
    returns them (defaults filled in: the deployment's sampling `defaults`)."""
    tools = [t.model_dump(mode="json", by_alias=True, exclude_none=True)
             | {"strict": t.strict is not False} if isinstance(t, FunctionTool)
             else t.echo() for t in req.tools or () if isinstance(t, FunctionTool | McpTool)]
    choice = req.tool_choice
    sampled = sampling_values(req, defaults)
    text: dict[str, Any] = {"format": {"type": "text"}, "verbosity": "medium"}
    if req.text is not None:
        text = req.text.model_dump(mode="json", by_alias=True, exclude_none=True)
        text.setdefault("format", {"type": "text"})
        text.setdefault("verbosity", "medium")
        if text["format"]["type"] == "json_schema":  # every field the spec requires
            text["format"] = {"description": None, "strict": False} | text["format"]
    return ResponseObject(
        created_at=int(time.time()), model=model, instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, max_tool_calls=req.max_tool_calls,
        temperature=sampled["temperature"], top_p=sampled["top_p"],
        presence_penalty=sampled["presence_penalty"],
        frequency_penalty=sampled["frequency_penalty"],
        tools=tools,
        tool_choice=choice.model_dump(mode="json") if isinstance(choice, FunctionChoice)
        else choice or "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False, text=text,
        top_logprobs=req.top_logprobs or 0,
        metadata=req.metadata or {}, previous_response_id=req.previous_response_id,
        store=req.store is not False, truncation=req.truncation or "disabled",
        service_tier="default" if req.service_tier in (None, "auto") else req.service_tier,
        user=req.user, safety_identifier=req.safety_identifier,
        prompt_cache_key=req.prompt_cache_key,
        prompt_cache_retention=req.prompt_cache_retention,
    )


def output_items(text: str, use: ToolUse | None,
                 logprobs: list[TokenLogprob] | None = None) -> list[OutputItem]:
    """A finished reply's output: its text as a message item (also when empty, unless the
    reply is calls only), then each call it made as a function_call item. `logprobs` (one
    per generated token) go with the text when the reply made no call (a call's tokens
    are not the message's)."""
    calls: list[ParsedCall]
    text, calls = split_tool_calls(text, use, new_call_id)  # markup never stays in text
    items: list[OutputItem] = []
    if text or not calls:
        part = OutputText(text=text, logprobs=[] if calls else logprobs or [])
        items.append(OutputMessage(content=[part]))
    items.extend(FunctionCallOutput(call_id=c.id, name=c.name, arguments=c.arguments)
                 for c in calls)
    return items


def finished(response: ResponseObject, finish_reason: str | None,
             usage: ResponseUsage) -> ResponseObject:
    """`response` (its output complete) with its outcome: "incomplete" when the reply
    ran out of tokens or was filtered, else "completed"; items not yet closed take it."""
    reason = finish_reason if finish_reason in INCOMPLETE_REASONS else None
    status: Literal["completed", "incomplete"] = "completed" if reason is None else "incomplete"
    for item in response.output:
        if item.status == "in_progress":
            item.status = status
    response.status = status
    response.usage = usage
    if reason is not None:
        response.incomplete_details = IncompleteDetails(
            reason="max_output_tokens" if reason == "length" else "content_filter")
    else:
        response.completed_at = int(time.time())
    return response
