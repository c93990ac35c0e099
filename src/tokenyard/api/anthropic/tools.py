"""Tools in the Anthropic dialect: `tools` and `tool_choice` in; `tool_use` blocks of
assistant turns and `tool_result` blocks of user turns rendered back into the
conversation; the reply's calls out as `tool_use` content blocks (`stop_reason:
tool_use`) and, streamed, as a tool_use `content_block_start` then `input_json_delta`
fragments. Rendering and parsing are `text/tools.py`'s, shared with the OpenAI dialect."""

from __future__ import annotations

import json
from collections.abc import Sequence

from tokenyard.api.anthropic.schemas import (
    CountTokensRequest,
    MessagesRequest,
    ResponseBlock,
    TextBlock,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
)
from tokenyard.api.convert import random_id
from tokenyard.text.content import TemplateMessage
from tokenyard.text.tools import (
    PastCall,
    Tool,
    ToolCallParser,
    ToolChoice,
    ToolResult,
    ToolUse,
    assistant_text,
    call_parser,
    results_text,
    split_tool_calls,
    with_tools,
)


def new_tool_use_id() -> str:
    """An id for a tool_use block ("toolu_…")."""
    return random_id("toolu_")


def tool_use(req: MessagesRequest | CountTokensRequest) -> ToolUse | None:
    """The request's tools and choice, or None when it sent no tools."""
    if not req.tools:
        return None
    tools = tuple(Tool(t.name, t.description, t.input_schema) for t in req.tools)
    choice = req.tool_choice
    if choice is None:
        return ToolUse(tools)
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        return ToolUse(tools, ToolChoice("required", choice.name, parallel))
    mode = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return ToolUse(tools, ToolChoice(mode, None, parallel))  # type: ignore[arg-type]


def tool_messages(req: MessagesRequest | CountTokensRequest,
                  messages: Sequence[TemplateMessage], use: ToolUse | None
                  ) -> list[TemplateMessage]:
    """`messages` (the system message, if any, then one per `req.messages`) with each
    turn's tool_use blocks written back after its text, tool_result blocks before the
    user's text, and the tools' system prompt when they are active."""
    names = {b.id: b.name for m in req.messages if not isinstance(m.content, str)
             for b in m.content if isinstance(b, ToolUseBlockParam)}
    out = list(messages)
    first = len(out) - len(req.messages)
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            continue
        calls = [PastCall(b.name, json.dumps(b.input, ensure_ascii=False))
                 for b in message.content if isinstance(b, ToolUseBlockParam)]
        results = [ToolResult(b.text, names.get(b.tool_use_id), bool(b.is_error))
                   for b in message.content if isinstance(b, ToolResultBlockParam)]
        if not calls and not results:
            continue
        text = out[first + i]["content"]
        if calls:
            text = assistant_text(text, calls)
        if results:
            text = "\n".join(p for p in (results_text(results), text) if p)
        out[first + i] = {**out[first + i], "content": text}
    return with_tools(out, use)


def content_blocks(text: str, use: ToolUse | None) -> tuple[list[ResponseBlock], bool]:
    """A finished reply's content blocks, and whether it made a call: with active tools,
    its calls as tool_use blocks after its text (a text block only when there is text)."""
    if use is None or not use.active:
        return [TextBlock(text=text)], False
    content, calls = split_tool_calls(text, use.names, new_tool_use_id)
    if not calls:
        return [TextBlock(text=content)], False
    blocks: list[ResponseBlock] = [TextBlock(text=content)] if content else []
    blocks.extend(ToolUseBlock(id=c.id, name=c.name, input=c.input or {}) for c in calls)
    return blocks, True


def parser(use: ToolUse | None) -> ToolCallParser | None:
    """A streaming parser of one reply's calls, or None when tools are not active."""
    return call_parser(use, new_tool_use_id)
