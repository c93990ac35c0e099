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
)
from tokenyard.api.anthropic.tool_schemas import ToolUseBlock, ToolUseBlockParam
from tokenyard.api.convert import random_id
from tokenyard.text.content import TemplateMessage
from tokenyard.text.tool_calls import ToolCallParser, call_parser, split_tool_calls
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


def new_tool_use_id() -> str:
    """An id for a tool_use block ("toolu_…")."""
    return random_id("toolu_")


def tool_use(req: MessagesRequest | CountTokensRequest, extra: tuple[Tool, ...] = ()
             ) -> ToolUse | None:
    """The request's tools (then `extra`: its MCP servers' tools) and choice, or None
    when it has no tools."""
    tools = tuple(Tool(t.name, t.description, t.input_schema) for t in req.tools or ()) + extra
    if not tools:
        return None
    choice = req.tool_choice
    if choice is None:
        return ToolUse(tools)
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        return ToolUse(tools, ToolChoice("required", choice.name, parallel))
    mode = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return ToolUse(tools, ToolChoice(mode, None, parallel))  # type: ignore[arg-type]


def tool_messages(req: MessagesRequest | CountTokensRequest,
                  messages: Sequence[TemplateMessage], use: ToolUse | None,
                  native: bool = False) -> list[TemplateMessage]:
    """`messages` (the system message, if any, then one per `req.messages`) with each
    turn's tool_use blocks and tool_result blocks as the template sees them (`native`: it
    renders tools; else calls written after the text, results before the user's text),
    and the tools' system prompt when they are active and the template renders none."""
    names = {b.id: b.name for m in req.messages if not isinstance(m.content, str)
             for b in m.content if isinstance(b, ToolUseBlockParam)}
    first = len(messages) - len(req.messages)
    out = list(messages[:first])
    for message, converted in zip(req.messages, messages[first:], strict=True):
        blocks = () if isinstance(message.content, str) else message.content
        calls = [PastCall(b.name, json.dumps(b.input, ensure_ascii=False))
                 for b in blocks if isinstance(b, ToolUseBlockParam)]
        results = [ToolResult(b.text, names.get(b.tool_use_id), bool(b.is_error))
                   for b in blocks if isinstance(b, ToolResultBlockParam)]
        if results:
            out += result_turns(results, native, converted["content"])
        elif calls:
            out.append(assistant_turn(converted, calls, native))
        else:
            out.append(converted)
    return with_tools(out, use, native)


def content_blocks(text: str, use: ToolUse | None) -> tuple[list[ResponseBlock], bool]:
    """A finished reply's content blocks, and whether it made a call: with active tools,
    its calls as tool_use blocks after its text (a text block only when there is text);
    tool markup never stays in the text, with or without tools."""
    content, calls = split_tool_calls(text, use, new_tool_use_id)
    if not calls:
        return [TextBlock(text=content)], False
    blocks: list[ResponseBlock] = [TextBlock(text=content)] if content else []
    blocks.extend(ToolUseBlock(id=c.id, name=c.name, input=c.input or {}) for c in calls)
    return blocks, True


def parser(use: ToolUse | None) -> ToolCallParser | None:
    """A streaming parser of one reply's calls, or None when tools are not active."""
    return call_parser(use, new_tool_use_id)
