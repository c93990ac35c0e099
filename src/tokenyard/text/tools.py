"""Tool calling in text: a request's tools as plain values, written out as text.

Both dialects meet here as plain values: a `Tool` (name, description, JSON schema of
its arguments), a `ToolChoice` (none / auto / required / one named tool, and whether
several calls may come in one turn), and calls and results of earlier turns.

How the model sees tools. A chat template that renders tools (it uses a `tools`
variable: Qwen 2.5, Hermes, ...) gets them as the function schemas it expects, past calls
as the assistant messages' `tool_calls` and results as `tool` messages (`native`).
SmolLM2's template (the embedded model's) renders none, so there the conversation carries
them itself — the fallback every template can render:

- the tools' JSON schemas go in the system prompt (merged into the client's own system
  message, or a new one first), with an instruction to answer a call as
  ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``, one tag per call;
- an assistant turn that made calls is rendered back the same way, after its text;
- tool results become a user turn the model can read, each as
  ``<tool_response>\n...\n</tool_response>``, in order: the form SmolLM2's tool-calling
  template gives them (its Ollama template; Hermes and Qwen 2.5 write them the same way),
  an error's text led by ``Error:``.

Tool markup (`MARKUP`) is parsed out of every reply, never stopped on and never sent as
text (`tokenyard.text.tool_calls`), and the grammar keeps the model from writing a
result of its own (`tokenyard.text.tool_grammar`).

An OpenAI-compatible upstream gets the tools as body fields (`openai_tools`), and its
streamed calls come back written as the same tags (`CallsAsText`).

Calls are parsed out of the output in `tokenyard.text.tool_calls`; the grammar that
forces valid ones is `tokenyard.text.tool_grammar`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from tokenyard.text.content import TemplateMessage

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"
#: The tags of the tool format: none of them reaches a reply's text.
MARKUP = (OPEN, CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, "<tools>", "</tools>")

Mode = Literal["none", "auto", "required"]


@dataclass(frozen=True)
class Tool:
    """A function the model may call: `parameters` is its arguments' JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    strict: bool = False

    def schema_json(self) -> str:
        """The tool as the system prompt lists it (one JSON object)."""
        entry: dict[str, Any] = {"name": self.name}
        if self.description:
            entry["description"] = self.description
        entry["parameters"] = self.parameters
        return json.dumps(entry, ensure_ascii=False)


@dataclass(frozen=True)
class ToolChoice:
    """What the request allows: `mode`, or the one tool `name` that must be called
    (mode "required"); `parallel` False: at most one call per turn. A named tool is one
    call whatever the request said of parallel calls (as OpenAI's and Anthropic's named
    choices are): its `parallel` is always False."""

    mode: Mode = "auto"
    name: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.name is not None and self.parallel:
            object.__setattr__(self, "parallel", False)


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and its choice among them."""

    tools: tuple[Tool, ...]
    choice: ToolChoice = ToolChoice()
    #: The most calls one response may make (the Responses API's `max_tool_calls`);
    #: None: the deployment's cap alone.
    max_calls: int | None = None
    #: The deployment's tool-call syntax when its model writes its own (text/tool_formats.py:
    #: "llama3_json", "mistral", ...); None: the `<tool_call>` form.
    syntax: str | None = None

    @property
    def active(self) -> bool:
        """Whether the model is told of the tools and its output parsed for calls."""
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the model may call (just the named one when a name is forced)."""
        if self.choice.name is None:
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice.name)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.offered)

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


@dataclass(frozen=True)
class PastCall:
    """A call an earlier assistant turn made: `arguments` as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolResult:
    """The result of a call, sent back by the client: `name` when known."""

    content: str
    name: str | None = None
    is_error: bool = False


# ---------------------------------------------------------------------------- rendering


def system_prompt(use: ToolUse) -> str:
    """The instruction and tool list the fallback puts in the system prompt."""
    listing = "\n".join(t.schema_json() for t in use.offered)
    if use.choice.name is not None:
        rule = f"You must call the function `{use.choice.name}` now."
    elif use.choice.mode == "required":
        rule = "You must call at least one function now."
    else:
        rule = "Call a function when it helps answer; otherwise answer in plain text."
    many = ("" if use.choice.parallel
            else " Make at most one call per reply.")
    return (
        "You can call functions. Each function is described by a JSON object below, "
        "with its arguments as a JSON schema:\n"
        f"<tools>\n{listing}\n</tools>\n"
        f"To call a function, write one {OPEN}{CLOSE} tag per call holding a JSON object "
        f'with the function\'s name and its arguments, like {OPEN}{{"name": "NAME", '
        f'"arguments": {{...}}}}{CLOSE}. {rule}{many} Function results come back to you '
        f"inside {RESPONSE_OPEN}{RESPONSE_CLOSE} tags."
    )


def call_begin(name: str) -> str:
    """How a call of `name` starts: the tag and its header, up to the arguments."""
    return f'{OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


#: How every call ends, after its arguments' object.
CALL_END = f"}}{CLOSE}"


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (`arguments`: JSON text of an object)."""
    return call_begin(name) + arguments + CALL_END


def assistant_text(text: str, calls: Sequence[PastCall]) -> str:
    """An assistant turn's content: its text, then each call it made, one per line."""
    parts = [text] if text else []
    parts.extend(call_text(c.name, c.arguments) for c in calls)
    return "\n".join(parts)


def results_text(results: Sequence[ToolResult]) -> str:
    """Tool results as the user turn that carries them back, in order, each in its
    ``<tool_response>`` tag on lines of its own (the calls' order names them)."""
    return "\n".join(
        f"{RESPONSE_OPEN}\n{'Error: ' if r.is_error else ''}{r.content}\n{RESPONSE_CLOSE}"
        for r in results)


#: A template that uses a `tools` variable renders tools itself.
_TEMPLATE_USES_TOOLS = re.compile(r"\{[{%][^}]*\btools\b")


def renders_tools(template: str | None) -> bool:
    """Whether a chat template renders tools (then it gets them `native`ly)."""
    return bool(template) and _TEMPLATE_USES_TOOLS.search(template or "") is not None


def _function_specs(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """Tools as OpenAI's (and the chat templates') function objects."""
    specs = []
    for t in tools:
        function: dict[str, Any] = {"name": t.name, "parameters": t.parameters}
        if t.description:
            function["description"] = t.description
        if t.strict:
            function["strict"] = True
        specs.append({"type": "function", "function": function})
    return specs


def template_tools(use: ToolUse | None, native: bool) -> list[dict[str, Any]] | None:
    """The `tools` a native template renders (the offered ones), or None."""
    if not native or use is None or not use.active:
        return None
    return _function_specs(use.offered)


def assistant_turn(message: TemplateMessage, calls: Sequence[PastCall], native: bool
                   ) -> TemplateMessage:
    """An assistant turn that made `calls`: as `tool_calls` for a native template (the
    arguments as an object, as templates expect), else written after its text."""
    if not native:
        return {**message, "content": assistant_text(message["content"], calls)}
    tool_calls = [{"type": "function", "function": {"name": c.name,
                                                    "arguments": _object_or_text(c.arguments)}}
                  for c in calls]
    return cast(TemplateMessage, {**message, "tool_calls": tool_calls})


def result_turns(results: Sequence[ToolResult], native: bool, text: str = ""
                 ) -> list[TemplateMessage]:
    """Tool results (and the user's `text` after them): one `tool` message each for a
    native template, else one user turn of ``<tool_response>`` tags then the text."""
    if not native:
        return [{"role": "user", "content": "\n".join(p for p in (results_text(results), text)
                                                     if p)}]
    turns = [cast(TemplateMessage, {"role": "tool", "content": r.content,
                                    **({"name": r.name} if r.name is not None else {})})
             for r in results]
    return turns + ([{"role": "user", "content": text}] if text else [])


def _object_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _results_only(message: TemplateMessage) -> bool:
    """Whether `message` is a user turn of tool results alone (`result_turns`)."""
    text = message["content"]
    return (message["role"] == "user" and "parts" not in message
            and text.startswith(RESPONSE_OPEN) and text.endswith(RESPONSE_CLOSE))


def continues_results(messages: Sequence[TemplateMessage]) -> bool:
    """Whether the conversation ends in an assistant turn that its tool results continue
    (`with_tools`): the reply goes on from there, the turn left open."""
    return (bool(messages) and messages[-1]["role"] == "assistant"
            and messages[-1]["content"].endswith(RESPONSE_CLOSE + "\n"))


def with_tools(messages: Sequence[TemplateMessage], use: ToolUse | None, native: bool = False
               ) -> list[TemplateMessage]:
    """The conversation with the tools' system prompt merged into its system message
    (or a new one first) when the tools are active and the template does not render
    them.

    With a template that renders no tools, results that end the conversation right after
    the assistant turn that made the calls continue that turn: its calls, then the
    results, each tag on a line, and the reply goes on from there (`continues_results`).
    That is where SmolLM2 itself writes a ``<tool_response>`` after its call; given the
    results as a user turn of their own it echoes them (or calls again) instead of
    answering (0 answers in 40 at its default sampling, 32 in 40 continuing the turn)."""
    out = list(messages)
    if (not native and len(out) >= 2 and _results_only(out[-1])
            and out[-2]["role"] == "assistant" and OPEN in out[-2]["content"]):
        call, results = out[-2], out.pop()
        out[-1] = {**call, "content": f"{call['content']}\n{results['content']}\n"}
    if use is None or not use.active or native:
        return out
    prompt = system_prompt(use)
    if out and out[0]["role"] == "system":
        first = out[0]
        out[0] = {**first, "content": f"{first['content']}\n\n{prompt}" if first["content"]
                  else prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


# ---------------------------------------------------------------------------- upstreams


def openai_tools(use: ToolUse) -> dict[str, Any]:
    """The body fields that pass `use` on to an OpenAI-compatible upstream that declares
    tools: `tools`, `tool_choice` and, when only one call is allowed,
    `parallel_tool_calls`."""
    choice: Any = use.choice.mode
    if use.choice.name is not None:
        choice = {"type": "function", "function": {"name": use.choice.name}}
    body: dict[str, Any] = {"tools": _function_specs(use.tools), "tool_choice": choice}
    if not use.choice.parallel:
        body["parallel_tool_calls"] = False
    return body


class CallsAsText:
    """An upstream's streamed `delta.tool_calls` written back as the tagged calls this
    module parses, so its calls reach either dialect like our own model's."""

    def __init__(self) -> None:
        self._open: int | None = None  # the upstream's index of the call being written

    def delta(self, tool_calls: Any) -> str:
        """Text for one chunk's `tool_calls` fragments (a new index opens a new call)."""
        out = []
        for fragment in tool_calls if isinstance(tool_calls, list) else ():
            if not isinstance(fragment, dict):
                continue
            function = fragment.get("function") or {}
            index = fragment.get("index", 0)
            if index != self._open:
                out.append(self.close())
                self._open = index
                out.append(call_begin(str(function.get("name") or "")))
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                out.append(arguments)
        return "".join(out)

    def close(self) -> str:
        """The end of the call being written, if one is."""
        if self._open is None:
            return ""
        self._open = None
        return CALL_END

