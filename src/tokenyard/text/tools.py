"""Tool calling in text: how the model sees tools, and tool calls parsed out of its output.

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
  ``<tool_response>{"name": ..., "content": ...}</tool_response>``, in order.

Parsing. `ToolCallParser` reads the generated text as it streams: plain text goes out
as it comes (whitespace next to a call is dropped), a call's start (its name) as soon as
its header ``{"name": "…", "arguments": `` is read, then its arguments' JSON text in
fragments, ending where the arguments object closes. A call whose header does not come
first is held whole until ``</tool_call>`` and parsed then; one that does not parse, or
names no given tool, stays text. `split_tool_calls` does the same for a finished text.

Forcing. `structural_tag` builds the grammar (an XGrammar structural tag, triggered on
``<tool_call>``) that makes a malformed call impossible: with `required` or a named tool
at least one call must come; with `auto` the model may write text, but once it opens a
call, the call is one of the tools' with arguments valid against its schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from tokenyard.text.content import TemplateMessage
from tokenyard.wire.sampling_params import GuidedDecoding, SamplingParams

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"

#: A call's header, written first: ``{"name": "NAME", "arguments": `` (spaces optional).
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

Mode = Literal["none", "auto", "required"]
#: The most stop strings a request may have (`SamplingParams.validate`).
MAX_STOP = 16


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
    (mode "required"); `parallel` False: at most one call per turn."""

    mode: Mode = "auto"
    name: str | None = None
    parallel: bool = True


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and its choice among them."""

    tools: tuple[Tool, ...]
    choice: ToolChoice = ToolChoice()

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
    """Tool results as the user turn that carries them back, in order."""
    out = []
    for r in results:
        body: dict[str, Any] = {}
        if r.name is not None:
            body["name"] = r.name
        body["content"] = r.content
        if r.is_error:
            body["is_error"] = True
        out.append(f"{RESPONSE_OPEN}{json.dumps(body, ensure_ascii=False)}{RESPONSE_CLOSE}")
    return "\n".join(out)


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


def with_tools(messages: Sequence[TemplateMessage], use: ToolUse | None, native: bool = False
               ) -> list[TemplateMessage]:
    """The conversation with the tools' system prompt merged into its system message
    (or a new one first) when the tools are active and the template does not render
    them; unchanged otherwise."""
    out = list(messages)
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


# ---------------------------------------------------------------------------- forcing


def structural_tag(use: ToolUse) -> dict[str, Any]:
    """The XGrammar structural tag that forces valid calls of `use`'s offered tools; each
    tag is one tool's header, its arguments by the tool's schema, and the closing
    ``}</tool_call>``. With `required` (or a named tool) the reply is calls only, one a
    line; with `auto` it is free text until ``<tool_call>`` triggers a call."""
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
    shape: dict[str, Any] = (
        {"type": "tags_with_separator", "separator": "\n", "at_least_one": True}
        if use.choice.mode == "required"
        else {"type": "triggered_tags", "triggers": [OPEN], "at_least_one": False}
    )
    shape.update(tags=tags, stop_after_first=not use.choice.parallel)
    return {"type": "structural_tag", "format": shape}


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema, an object when it says no type (``{}`` included):
    a call's arguments are always an object."""
    return schema if "type" in schema else {"type": "object", **schema}


def constrained(params: SamplingParams, use: ToolUse | None) -> SamplingParams:
    """`params` for a reply that may call `use`'s tools: ``<tool_response>`` stops it (the
    model would be writing a result it has not got), and the grammar that forces valid
    calls (`structural_tag`) is set unless another one (a response_format) already is.
    Unchanged when the tools are not active."""
    if use is None or not use.active:
        return params
    stop = params.stop if len(params.stop) >= MAX_STOP else [*params.stop, RESPONSE_OPEN]
    if params.guided is not None:
        return replace(params, stop=stop)
    spec = json.dumps(structural_tag(use), ensure_ascii=False)
    return replace(params, stop=stop,
                   guided=GuidedDecoding("structural_tag", spec, param="tools"))


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


# ---------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class TextPiece:
    """Plain text of the reply."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """Call `index` (0, 1, … within the reply) begins: its id and name are known."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """The next fragment of call `index`'s arguments (JSON text)."""

    index: int
    fragment: str


ToolEvent = TextPiece | CallStart | CallArguments


@dataclass
class ParsedCall:
    """A call read from the output: `arguments` is its JSON text; `complete` once its
    tag closed; `raw` the text it was read from (what it becomes if it is no call)."""

    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False
    raw: str = ""

    @property
    def input(self) -> dict[str, Any] | None:
        """The arguments as an object, or None when they are not one."""
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    @property
    def valid(self) -> bool:
        return self.complete and self.input is not None


class _ArgumentsScanner:
    """Where a JSON object ends, read a character at a time (strings and escapes known)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def take(self, text: str) -> int:
        """How many characters of `text` still belong to the object (all of it when it
        has not closed yet)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return len(text)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Splits streamed output into text and the calls of tools named in `names`.

    `feed` each new piece of text and send the events it returns; `finish` at the end.
    `calls` holds every call read, in order; `new_id` names each call.
    """

    def __init__(self, names: Collection[str], new_id: Callable[[], str]) -> None:
        self.names = frozenset(names)
        self.new_id = new_id
        self.calls: list[ParsedCall] = []
        self._buf = ""  # TEXT: not yet sent; CALL: the call's body read so far
        self._in_call = False
        self._call: ParsedCall | None = None  # the call being streamed, header read
        self._scanner: _ArgumentsScanner | None = None
        self._args_done = False
        self._ws = ""  # trailing whitespace held back: dropped if a call follows
        self._after_call = False
        self._events: list[ToolEvent] = []

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> list[ToolEvent]:
        """Events for the next piece of output text."""
        self._buf += text
        while self._step():
            pass
        events, self._events = self._events, []
        return events

    def finish(self) -> list[ToolEvent]:
        """Events for what was held back once the output ended. A call whose tag never
        closed stays in `calls`, incomplete (streamed already); an unread one is text."""
        if self._in_call and self._call is None:
            self._text(OPEN + self._buf)
        elif not self._in_call:
            self._text(self._buf)
        self._buf = ""
        if not self._after_call and self._ws:
            self._events.append(TextPiece(self._ws))
        self._ws = ""
        events, self._events = self._events, []
        return events

    # -- states

    def _step(self) -> bool:
        """Move on as far as the buffer allows; True when more may follow at once."""
        if not self._in_call:
            at = self._buf.find(OPEN)
            if at < 0:
                keep = _held_prefix(self._buf, OPEN)
                self._text(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return False
            self._text(self._buf[:at])
            self._buf = self._buf[at + len(OPEN):]
            self._in_call = True
            return True
        if self._call is None:
            return self._read_header()
        return self._read_arguments()

    def _read_header(self) -> bool:
        match = _HEADER.match(self._buf)
        if match is not None and match.end() < len(self._buf):
            name = _json_string(match.group(1))
            if name in self.names and self._buf[match.end()] == "{":
                self._call = ParsedCall(len(self.calls), self.new_id(), name,
                                        raw=self._ws + OPEN + self._buf[:match.end()])
                self.calls.append(self._call)
                self._events.append(CallStart(self._call.index, self._call.id, name))
                self._ws = ""
                self._scanner, self._args_done = _ArgumentsScanner(), False
                self._buf = self._buf[match.end():]
                return True
        end = self._buf.find(CLOSE)
        if end < 0:
            return False  # the header or the whole call is still to come
        self._whole_call(self._buf[:end])
        self._buf = self._buf[end + len(CLOSE):]
        return True

    def _read_arguments(self) -> bool:
        call, scanner = self._call, self._scanner
        assert call is not None and scanner is not None
        if not self._args_done:
            n = scanner.take(self._buf)
            piece, self._buf = self._buf[:n], self._buf[n:]
            if piece:
                call.arguments += piece
                call.raw += piece
                self._events.append(CallArguments(call.index, piece))
            self._args_done = scanner.depth == 0
            if not self._args_done:
                return False
        end = self._buf.find(CLOSE)
        if end < 0:
            return False
        call.raw += self._buf[:end] + CLOSE
        call.complete = True
        self._buf = self._buf[end + len(CLOSE):]
        self._call, self._scanner, self._in_call = None, None, False
        self._after_call = True
        return True

    def _whole_call(self, body: str) -> None:
        """A call read whole (its header did not come first): a call of a given tool
        when it parses, else text."""
        self._in_call = False
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        name = value.get("name") if isinstance(value, dict) else None
        args = value.get("arguments") if isinstance(value, dict) else None
        if isinstance(args, str):  # arguments sent as a JSON string, as OpenAI spells them
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if name not in self.names or not isinstance(args, dict):
            self._text(OPEN + body + CLOSE)
            return
        assert isinstance(name, str)
        arguments = json.dumps(args, ensure_ascii=False)
        call = ParsedCall(len(self.calls), self.new_id(), name, arguments, True,
                          OPEN + body + CLOSE)
        self.calls.append(call)
        self._events += [CallStart(call.index, call.id, name),
                         CallArguments(call.index, arguments)]
        self._ws = ""
        self._after_call = True

    def _text(self, text: str) -> None:
        if not text:
            return
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            self._events.append(TextPiece(body))
            self._after_call = False


def call_parser(use: ToolUse | None, new_id: Callable[[], str]) -> ToolCallParser | None:
    """A streaming parser of one reply's calls, or None when tools are not active."""
    if use is None or not use.active:
        return None
    return ToolCallParser(use.names, new_id)


def _json_string(raw: str) -> str | None:
    try:
        value = json.loads(f'"{raw}"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def split_tool_calls(text: str, names: Collection[str], new_id: Callable[[], str]
                     ) -> tuple[str, list[ParsedCall]]:
    """A finished reply's text and its valid calls; a call that never closed or whose
    arguments are no JSON object stays in the text, as written."""
    parser = ToolCallParser(names, new_id)
    pieces: list[str] = []
    calls: list[ParsedCall] = []
    for event in parser.feed(text) + parser.finish():
        if isinstance(event, TextPiece):
            pieces.append(event.text)
        elif isinstance(event, CallStart):
            call = parser.calls[event.index]
            if call.valid:
                calls.append(call)
            else:
                pieces.append(call.raw)
    for i, call in enumerate(calls):
        call.index = i
    return "".join(pieces), calls
