"""Tools in the OpenAI dialect: `tools`, `tool_choice` and `parallel_tool_calls` in; past
calls (`tool_calls` of assistant messages) and results (`role: tool`) rendered back into
the conversation; the reply's calls out as `message.tool_calls` and as streamed
`delta.tool_calls[i]` fragments. The rendering and parsing themselves are
`text/tools.py`'s, shared with the Anthropic dialect."""

from __future__ import annotations

from collections.abc import Sequence

from tokenyard.api.convert import random_id
from tokenyard.api.openai.schemas import (
    AssistantMessage,
    ChatCompletionRequest,
    FinishReason,
)
from tokenyard.api.openai.tool_schemas import (
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
)
from tokenyard.text.content import TemplateMessage
from tokenyard.text.tool_calls import (
    CallArguments,
    CallStart,
    TextPiece,
    ToolCallParser,
    ToolEvent,
    call_parser,
    split_tool_calls,
)
from tokenyard.text.tools import (
    PastCall,
    Tool,
    ToolChoice,
    ToolResult,
    ToolUse,
    assistant_turn,
    result_turns,
    with_tools,
)
from tokenyard.wire.outputs import Completion


def new_call_id() -> str:
    """An id for a tool call ("call_…")."""
    return random_id("call_")


def tool_use(req: ChatCompletionRequest) -> ToolUse | None:
    """The request's tools and choice, or None when it sent no tools."""
    if not req.tools:
        return None
    tools = tuple(
        Tool(t.function.name, t.function.description,
             t.function.parameters or {"type": "object", "properties": {}},
             bool(t.function.strict))
        for t in req.tools
    )
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        return ToolUse(tools, ToolChoice("required", choice.function.name, parallel))
    return ToolUse(tools, ToolChoice(choice or "auto", None, parallel))


def tool_messages(req: ChatCompletionRequest, messages: Sequence[TemplateMessage],
                  use: ToolUse | None, native: bool = False) -> list[TemplateMessage]:
    """`messages` (converted one for one from `req.messages`) with past calls and
    results as the template sees them (`native`: it renders tools; else written into the
    turns, consecutive results as one user turn) and the tools' system prompt when they
    are active and the template does not render them."""
    names = {c.id: c.function.name for m in req.messages for c in m.tool_calls or ()}
    out: list[TemplateMessage] = []
    results: list[ToolResult] = []  # consecutive tool messages, rendered together
    for message, converted in zip(req.messages, messages, strict=True):
        if message.role == "tool":
            results.append(ToolResult(message.text, names.get(message.tool_call_id or "")))
            continue
        if results:
            out += result_turns(results, native)
            results = []
        if message.role == "assistant" and message.tool_calls:
            calls = [PastCall(c.function.name, c.function.arguments) for c in message.tool_calls]
            converted = assistant_turn(converted, calls, native)
        out.append(converted)
    if results:
        out += result_turns(results, native)
    return with_tools(out, use, native)


def _tool_call(name: str, call_id: str, arguments: str) -> ToolCall:
    return ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))


def assistant_message(completion: Completion, use: ToolUse | None,
                      finish: FinishReason) -> tuple[AssistantMessage, FinishReason]:
    """A finished choice's message and finish reason: with active tools, its calls
    split out of the text (finish "tool_calls" when it stopped having made one); tool
    markup never stays in the text, with or without tools."""
    content, calls = split_tool_calls(completion.text, use, new_call_id)
    if not calls:
        return AssistantMessage(content=content), finish
    return (
        AssistantMessage(content=content or None,
                         tool_calls=[_tool_call(c.name, c.id, c.arguments) for c in calls]),
        "tool_calls" if finish == "stop" else finish,
    )


def parser(use: ToolUse | None) -> ToolCallParser | None:
    """A streaming parser of one reply's calls, or None when tools are not active."""
    return call_parser(use, new_call_id)


def delta_parts(events: Sequence[ToolEvent]) -> tuple[str, list[ToolCallDelta]]:
    """One step's text and its calls' fragments, merged per call: the first fragment of
    a call carries its id, type and name."""
    text = "".join(e.text for e in events if isinstance(e, TextPiece))
    deltas: dict[int, ToolCallDelta] = {}
    for e in events:
        if isinstance(e, CallStart):
            deltas[e.index] = ToolCallDelta(index=e.index, id=e.id, type="function",
                                            function={"name": e.name, "arguments": ""})
        elif isinstance(e, CallArguments):
            delta = deltas.setdefault(e.index, ToolCallDelta(index=e.index,
                                                             function={"arguments": ""}))
            delta.function["arguments"] += e.fragment
    return text, list(deltas.values())
