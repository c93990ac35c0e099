"""The grammar that forces a reply's tool calls to be valid.

`structural_tag` builds the grammar (an XGrammar structural tag, triggered on
``<tool_call>``) that makes a malformed call impossible: with `required` or a named tool
at least one call must come; with `auto` the model may write text, but once it opens a
call, the call is one of the tools' with arguments valid against its schema (and, one
call at most, the reply is not empty: text or a call, `_answers`). The number
of calls is bounded (the request's `max_calls`, the deployment's cap): once the last one
allowed is written, the grammar allows only the end of the turn, so a small model that
opens call after call cannot run until the output cap.

The free text around calls cannot hold tool markup (`TEXT_EXCLUDES`): after a tool result
SmolLM2's likeliest reply is a ``<tool_response>`` of its own, the result echoed or made
up. A stop string there ended the reply empty; the grammar makes the model answer instead,
and markup that still comes (a reply under another grammar) is parsed out of the text,
never sent (`tokenyard.text.tool_calls`). With tools offered but `tool_choice` "none" the
reply is text without any markup (`markup_free`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from tokenyard.deployments import DEFAULT_MAX_TOOL_CALLS
from tokenyard.text.tools import CALL_END, OPEN, ToolUse, call_begin
from tokenyard.wire.sampling_params import GuidedDecoding, SamplingParams

#: What free text may not hold: the start of a tool result (``<tool_response>`` and the
#: variants a small model makes of it: ``<tool_response_json>``), any closing tool tag, and
#: the tool list's tag. A call's own ``</tool_call>`` is inside its tag, not free text.
TEXT_EXCLUDES = ["<tool_r", "</tool", "<tools"]


def call_limit(use: ToolUse, cap: int | None) -> int | None:
    """The most calls one reply of `use` may make: one without parallel calls, else the
    least of the request's `max_calls` and the deployment's `cap` (None: unbounded)."""
    if not use.choice.parallel:
        return 1
    limits = [n for n in (use.max_calls, cap) if n is not None]
    return min(limits) if limits else None


def structural_tag(use: ToolUse, limit: int | None = None) -> dict[str, Any]:
    """The XGrammar structural tag that forces valid calls of `use`'s offered tools; each
    tag is one tool's header, its arguments by the tool's schema, and the closing
    ``}</tool_call>``. With `required` (or a named tool) the reply is calls only, one a
    line; with `auto` it is free text until ``<tool_call>`` triggers a call. `limit`
    (`call_limit`; None: unbounded) bounds the calls: after the last, only the end."""
    tags = [
        {
            "begin": call_begin(t.name),
            # One whitespace character at a time at most: a small model can otherwise
            # fill max_tokens with newlines inside a call.
            "content": {"type": "json_schema", "json_schema": _object_schema(t.parameters),
                        "max_whitespace_cnt": 1},
            "end": CALL_END,
        }
        for t in use.offered
    ]
    if limit is not None and limit > 1 and use.choice.parallel:
        return {"type": "structural_tag", "format": _bounded(use, tags, limit)}
    shape: dict[str, Any] = (
        {"type": "tags_with_separator", "separator": "\n", "at_least_one": True}
        if use.choice.mode == "required"
        else {"type": "triggered_tags", "triggers": [OPEN], "at_least_one": False,
              "excludes": TEXT_EXCLUDES}
    )
    shape.update(tags=tags, stop_after_first=not use.choice.parallel or limit == 1)
    if use.choice.mode != "required":
        shape = _answers(shape)
    return {"type": "structural_tag", "format": shape}


def _answers(free: dict[str, Any]) -> dict[str, Any]:
    """`free` (text that may call) never empty: a call, or text whose first character
    past the whitespace is no tag. A reply that ends at once, or a ``\n`` then the end,
    answers nothing (SmolLM2 does so about once in 20 at temperature 1 after a result)."""
    return {"type": "or", "elements": [
        {**free, "at_least_one": True},
        {"type": "sequence", "elements": [{"type": "regex", "pattern": r"\s*[^\s<]"}, free]},
    ]}


def _bounded(use: ToolUse, tags: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """At most `limit` (> 1) calls: a first call and up to limit - 1 more, a line apart,
    for `required`; for `auto`, up to limit - 1 calls each after free text (which may
    not open a call of its own), then the unbounded form stopping after its first."""
    call = {"type": "or", "elements": [{"type": "tag", **t} for t in tags]}
    if use.choice.mode == "required":
        more = {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"}, call]}
        return {"type": "sequence", "elements": [
            call, {"type": "repeat", "min": 0, "max": limit - 1, "content": more}]}
    text_then_call = {"type": "sequence", "elements": [
        {"type": "any_text", "excludes": [OPEN, *TEXT_EXCLUDES]}, call]}
    return {"type": "sequence", "elements": [
        {"type": "repeat", "min": 0, "max": limit - 1, "content": text_then_call},
        {"type": "triggered_tags", "triggers": [OPEN], "tags": tags, "at_least_one": False,
         "stop_after_first": True, "excludes": TEXT_EXCLUDES},
    ]}


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema, an object when it says no type (``{}`` included):
    a call's arguments are always an object."""
    return schema if "type" in schema else {"type": "object", **schema}


def markup_free() -> dict[str, Any]:
    """The structural tag of a reply in text alone: no call, no tool markup."""
    return {"type": "structural_tag",
            "format": {"type": "any_text", "excludes": [OPEN, *TEXT_EXCLUDES]}}


def constrained(
    params: SamplingParams, use: ToolUse | None, max_calls: int | None = DEFAULT_MAX_TOOL_CALLS
) -> SamplingParams:
    """`params` for a reply that may call `use`'s tools: the grammar that forces valid
    calls in markup-free text (`structural_tag`) is set unless another one (a
    response_format) already is and the choice lets the model answer in text. A forced
    call (required, or a named tool) takes the grammar even then, as OpenAI's tool_choice
    does: the reply is calls only, which a text format does not govern (instructor sends
    both in its Responses mode). `max_calls` is the deployment's cap on calls per
    response (`call_limit`). Tools offered with `tool_choice` "none": text without
    markup (`markup_free`), unless another grammar is set. Unchanged without tools."""
    if use is None or not use.tools:
        return params
    if params.guided is not None and use.choice.mode != "required":
        return params
    spec = markup_free() if not use.active else structural_tag(use, call_limit(use, max_calls))
    return replace(params, guided=GuidedDecoding(
        "structural_tag", json.dumps(spec, ensure_ascii=False), param="tools"))
