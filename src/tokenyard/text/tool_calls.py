"""Tool calls parsed out of the model's output, as it streams.

`ToolCallParser` reads the generated text as it streams: plain text goes out
as it comes (whitespace next to a call is dropped), a call's start (its name) as soon as
its header ``{"name": "…", "arguments": `` is read, then its arguments' JSON text in
fragments, ending where the arguments object closes. A call whose header does not come
first is held whole until ``</tool_call>`` and parsed then. Tool markup never reaches the
text: a call that does not parse or names no given tool (every call, when no tool is
active) is dropped, and so is a ``<tool_response>`` the model wrote itself (a result it
has not got: it is parsed out, the reply goes on) and any stray closing tag.
`split_tool_calls` does the same for a finished text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from tokenyard.text.tool_formats import native_calls
from tokenyard.text.tools import CLOSE, OPEN, RESPONSE_CLOSE, RESPONSE_OPEN, ToolUse

#: A call's header, written first: ``{"name": "NAME", "arguments": `` (spaces optional).
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


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
    """Length of the longest end of `text` that could be the start of `tag`. Every tag
    holds one ``<``, its first character, so only the end from the last ``<`` can be."""
    at = text.rfind("<", max(0, len(text) - len(tag) + 1))
    return len(text) - at if at >= 0 and tag.startswith(text[at:]) else 0


#: Tags met in the text: a call opens; a result the model writes is skipped to its end;
#: a stray closing tag is dropped.
_TAGS = (OPEN, RESPONSE_OPEN, CLOSE, RESPONSE_CLOSE)


def _first_tag(text: str) -> tuple[int, str]:
    """Where the first of `_TAGS` starts in `text`, and which (-1, "" for none)."""
    found = [(at, tag) for tag in _TAGS if (at := text.find(tag)) >= 0]
    return min(found, key=lambda f: f[0]) if found else (-1, "")


class ToolCallParser:
    """Splits streamed output into text and the calls of tools named in `names`.

    `feed` each new piece of text and send the events it returns; `finish` at the end.
    `calls` holds every call read, in order; `new_id` names each call. `forced`: the
    reply is calls only (required, or a named tool), so the start of a tag cut at the
    end is no text either. `syntax`: the model's own call syntax, rewritten into this
    form first (text/tool_formats.py).
    """

    def __init__(self, names: Collection[str], new_id: Callable[[], str],
                 forced: bool = False, syntax: str | None = None) -> None:
        self._native = native_calls(syntax)
        self.names = frozenset(names)
        self.new_id = new_id
        self.forced = forced
        self.calls: list[ParsedCall] = []
        self._buf = ""  # TEXT: not yet sent; CALL: the call's body read so far
        self._in_call = False
        self._in_result = False  # inside a <tool_response> the model wrote: dropped
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
        self._buf += text if self._native is None else self._native.feed(text)
        while self._step():
            pass
        events, self._events = self._events, []
        return events

    def finish(self) -> list[ToolEvent]:
        """Events for what was held back once the output ended. A call whose tag never
        closed (the output cut inside it) is never text: one whose header was read stays
        in `calls`, incomplete (streamed already); one cut before that is dropped, with
        the whitespace before it (as are an unclosed result, and a cut ``<tool_`` when
        the reply is `forced`)."""
        if self._native is not None:
            self._buf += self._native.finish()
            while self._step():
                pass
        if self._in_call or self._in_result or (
                self.forced and OPEN.startswith(self._buf.strip())):
            self._ws = ""
        else:
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
        if self._in_result:
            end = self._buf.find(RESPONSE_CLOSE)
            if end < 0:
                keep = _held_prefix(self._buf, RESPONSE_CLOSE)
                self._buf = self._buf[len(self._buf) - keep:]
                return False
            self._buf = self._buf[end + len(RESPONSE_CLOSE):]
            self._in_result = False
            return True
        if not self._in_call:
            if "<" not in self._buf:  # plain text, the common piece: no tag, none begun
                self._text(self._buf)
                self._buf = ""
                return False
            at, tag = _first_tag(self._buf)
            if at < 0:
                keep = max(_held_prefix(self._buf, t) for t in _TAGS)
                self._text(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return False
            self._text(self._buf[:at])
            self._buf = self._buf[at + len(tag):]
            self._in_call = tag == OPEN
            self._in_result = tag == RESPONSE_OPEN
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
            return  # markup, not a call: never text
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


def reply_parser(use: ToolUse | None, new_id: Callable[[], str]) -> ToolCallParser:
    """A parser of one reply: its calls when tools are active; without, it makes no call
    and only keeps the markup the model writes out of the text."""
    active = use is not None and use.active
    return ToolCallParser(use.names if use is not None and active else (), new_id,
                          active and use is not None and use.choice.mode == "required",
                          use.syntax if use is not None else None)


def call_parser(use: ToolUse | None, new_id: Callable[[], str]) -> ToolCallParser | None:
    """A streaming parser of one reply's calls, or None when tools are not active (then
    a `MarkupFilter` keeps the text clean)."""
    return reply_parser(use, new_id) if use is not None and use.active else None


class MarkupFilter:
    """The streamed text of a reply made without active tools, the tool markup the model
    writes (calls, results, stray tags) parsed out: it never reaches the content."""

    def __init__(self, use: ToolUse | None = None) -> None:
        self._parser = reply_parser(use, _no_calls)

    def feed(self, text: str, final: bool = False) -> str:
        """The clean text of the next piece (`final`: the reply ends with it)."""
        events = self._parser.feed(text)
        if final:
            events += self._parser.finish()
        return "".join(e.text for e in events if isinstance(e, TextPiece))


def _no_calls() -> str:
    raise AssertionError("a reply without active tools makes no call")


def _json_string(raw: str) -> str | None:
    try:
        value = json.loads(f'"{raw}"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def split_tool_calls(text: str, use: ToolUse | None, new_id: Callable[[], str] = _no_calls
                     ) -> tuple[str, list[ParsedCall]]:
    """A finished reply's text and its valid calls (none without active tools: then the
    text alone, its markup parsed out). A call that never closed (the reply was cut
    inside it), or closed with arguments that are no JSON object, is neither: its markup
    never reaches the text."""
    parser = reply_parser(use, new_id)
    pieces: list[str] = []
    calls: list[ParsedCall] = []
    for event in parser.feed(text) + parser.finish():
        if isinstance(event, TextPiece):
            pieces.append(event.text)
        elif isinstance(event, CallStart):
            call = parser.calls[event.index]
            if call.valid:
                calls.append(call)
    for i, call in enumerate(calls):
        call.index = i
    return "".join(pieces), calls
