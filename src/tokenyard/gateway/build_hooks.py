"""What a dialect's `build` hook uses for the deployment the pipeline picked
(`gateway/pipeline.py`): where the request's tools go, the deployment's prepare stage, and the
sizes the pipeline bounds before anything is tokenized."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from tokenyard.errors import invalid_request
from tokenyard.gateway.kinds import kind_of
from tokenyard.gateway.routing import require
from tokenyard.gateway.served import Served
from tokenyard.text.content import TemplateMessage
from tokenyard.text.prepare import Preparer
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.text.tools import ToolUse, renders_tools

__all__ = ["ToolPlacement", "first_user_text", "placed", "preparer", "text_size"]


class ToolPlacement(NamedTuple):
    """Where a request's tools go: `prompt` (rendered into it, calls forced by the
    grammar), `passed_on` (in an upstream's body), `native` (the engine's chat template
    renders tools itself; else `text/tools.py`'s system-prompt fallback)."""

    prompt: ToolUse | None
    passed_on: ToolUse | None
    native: bool


def placed(tools: ToolUse | None, served: Served) -> ToolPlacement:
    """Where `tools` go on deployment `served`: an upstream gets active tools passed on,
    an engine in its prompt; 400 naming `tools` for a deployment that does not declare
    them."""
    passes_on = kind_of(served.spec).passes_tools_on
    native = (not passes_on and served.tokenizer is not None
              and renders_tools(served.tokenizer.chat_template))
    if tools is None or not tools.active:
        return ToolPlacement(tools, None, native)
    if native or served.spec.tool_call_parser != "auto":
        # The model writes calls its own way (the fallback prompt teaches <tool_call>).
        tools = replace(tools, syntax=served.tool_syntax)
    require(served.spec, "tools", "tools")
    if passes_on:
        return ToolPlacement(None, tools, native)
    return ToolPlacement(tools, None, native)


def preparer(served: Served) -> tuple[Preparer, Tokenizer]:
    """The deployment's prepare stage (its `Preparer`) and tokenizer (400 for a kind that
    has none)."""
    if served.preparer is None or served.tokenizer is None:
        raise invalid_request(f"The model `{served.name}` does not generate text.",
                              param="model", code="model_not_supported")
    return served.preparer, served.tokenizer


def first_user_text(messages: Sequence[Any]) -> str | None:
    """The first user message's text (what a conversation's canary draw sticks to)."""
    for message in messages:
        if message.get("role") == "user":
            return str(message.get("content") or "")
    return None


def text_size(messages: Sequence[TemplateMessage]) -> int:
    """The characters of a conversation's text contents (what `Call.text_size` bounds)."""
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
