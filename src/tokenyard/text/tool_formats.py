"""Each model family's own tool-call syntax, rewritten into the one `tool_calls.py` reads.

tokenyard's parser (text/tool_calls.py) reads calls written as
``<tool_call>{"name": …, "arguments": {…}}</tool_call>``: the Hermes format that Qwen2.5
and Qwen3 write themselves, and the one text/tools.py teaches a model without tools in
its chat template. Other families write their calls differently:

- ``llama3_json`` (Llama 3.1-3.3): the reply is one JSON object
  ``{"name": …, "parameters": {…}}`` (several are separated by ``;``), optionally after
  ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects,
  or (tokenizer v11+) ``[TOOL_CALLS]name[ARGS]{…}`` once per call;
- ``phi4_mini_json`` (Phi-4-mini; Phi-3 has no tool format of its own):
  ``functools[{"name": …, "arguments": {…}}, …]``.

A `NativeCalls` translator is fed the streamed text and returns text in which every call
is rewritten into the Hermes form, plain text unchanged; a call is held until it is whole.
`TOOL_CALL_PARSERS` names them (``hermes`` needs none); `detect_tool_parser` picks one
from a chat template.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from tokenyard.config import TOOL_CALL_PARSERS
from tokenyard.text.tools import CLOSE, OPEN

__all__ = ["TOOL_CALL_PARSERS", "detect_tool_parser", "native_calls"]

_PYTHON_TAG = "<|python_tag|>"
_MISTRAL = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"
_PHI = "functools"
_BARE_CALLS = re.compile(r"\[\s*\{")


class NativeCalls(Protocol):
    """Streams one reply, rewriting a family's calls into the Hermes form."""

    def feed(self, text: str) -> str: ...

    def finish(self) -> str: ...


def hermes_call(name: Any, arguments: Any) -> str | None:
    """One call in the Hermes form, or None when `name`/`arguments` are not a call."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}{body}{CLOSE}"


def _calls_text(values: list[Any], arguments_key: str) -> str | None:
    """Hermes text of a list of call objects; None if any of them is no call."""
    out = []
    for value in values:
        if not isinstance(value, dict):
            return None
        call = hermes_call(value.get("name"), value.get(arguments_key, value.get("arguments")))
        if call is None:
            return None
        out.append(call)
    return "".join(out) if out else None


def json_end(text: str, start: int) -> int | None:
    """Index just past the JSON array/object that opens at `text[start]`; None if it has
    not closed yet."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could start `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class MarkerCalls:
    """Text until `marker`; after it, the family's calls (parsed by `_calls`), rewritten.

    What follows the marker is held until its calls are whole; what does not parse as
    calls goes out as it was written (marker included), as text.
    """

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self._buf = ""
        self._inside = False
        self._opened = marker  # what opened the calls: given back if they do not parse

    def feed(self, text: str) -> str:
        self._buf += text
        out = []
        while True:
            if not self._inside:
                at = self._buf.find(self.marker)
                if at < 0:
                    keep = held_prefix(self._buf, self.marker)
                    out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return "".join(out)
                out.append(self._buf[:at])
                self._buf = self._buf[at + len(self.marker):]
                self._inside, self._opened = True, self.marker
            parsed = self._calls(self._buf, final=False)
            if parsed is None:
                return "".join(out)
            text_out, used = parsed
            out.append(text_out)
            self._buf = self._buf[used:]
            self._inside = False

    def finish(self) -> str:
        rest, self._buf = self._buf, ""
        if not self._inside:
            return rest
        self._inside = False
        parsed = self._calls(rest, final=True)
        if parsed is None or parsed[1] < len(rest.rstrip()):
            return self._opened + rest
        return parsed[0]

    def _calls(self, text: str, final: bool) -> tuple[str, int] | None:
        """(Hermes text or the original text, characters used) of the calls at the start
        of `text`; None while they may still be incomplete."""
        start = len(text) - len(text.lstrip())
        if start == len(text):
            return ("", len(text)) if final else None
        if text[start] != "[":
            return (self._opened + text, len(text)) if final else None
        end = json_end(text, start)
        if end is None:
            return (self._opened + text, len(text)) if final else None
        try:
            values = json.loads(text[start:end])
        except ValueError:
            values = None
        calls = _calls_text(values, "arguments") if isinstance(values, list) else None
        return (calls, end) if calls is not None else (self._opened + text[:end], end)


class MistralCalls(MarkerCalls):
    """``[TOOL_CALLS][{…}, …]``, or v11's ``[TOOL_CALLS]name[ARGS]{…}`` per call.

    ``[TOOL_CALLS]`` is a control token of Mistral's tokenizers, which the default
    `skip_special_tokens` drops from the text: a reply that opens with an array of objects
    (``[{``) is read as the calls it would have introduced.
    """

    def __init__(self) -> None:
        super().__init__(_MISTRAL)
        self._began = False

    def feed(self, text: str) -> str:
        if not self._began:
            head = (self._buf + text).lstrip()
            if head in ("", "[") or (head.startswith("[") and not head[1:].strip()):
                self._buf += text
                return ""
            self._began = True
            if _BARE_CALLS.match(head) and not head.startswith(self.marker):
                self._inside, self._opened = True, ""
        return super().feed(text)

    def _calls(self, text: str, final: bool) -> tuple[str, int] | None:
        if text.lstrip().startswith("[") or not text.strip():
            return super()._calls(text, final)
        args_at = text.find(_MISTRAL_ARGS)
        if args_at < 0:
            return (self._opened + text, len(text)) if final else None
        name = text[:args_at].strip()
        start = args_at + len(_MISTRAL_ARGS)
        start += len(text[start:]) - len(text[start:].lstrip())
        end = json_end(text, start) if start < len(text) and text[start] == "{" else None
        if end is None:
            return (self._opened + text, len(text)) if final else None
        try:
            arguments = json.loads(text[start:end])
        except ValueError:
            arguments = None
        call = hermes_call(name, arguments)
        return (call, end) if call is not None else (self._opened + text[:end], end)


class Llama3Calls:
    """A reply that is JSON ``{"name", "parameters"}`` object(s), after an optional
    ``<|python_tag|>``: held whole, rewritten at the end. Any other reply is text."""

    def __init__(self) -> None:
        self._buf = ""
        self._decided: bool | None = None  # True: a call reply; False: plain text

    def feed(self, text: str) -> str:
        if self._decided is False:
            return text
        self._buf += text
        head = self._buf.lstrip()
        if not head:
            return ""
        if head.startswith("{") or head.startswith(_PYTHON_TAG):
            self._decided = True
            return ""
        if _PYTHON_TAG.startswith(head):
            return ""
        self._decided = False
        out, self._buf = self._buf, ""
        return out

    def finish(self) -> str:
        rest, self._buf = self._buf, ""
        if not self._decided:
            return rest
        body = rest.strip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG):].strip()
        values: list[Any] = []
        for part in _split_objects(body):
            try:
                values.append(json.loads(part))
            except ValueError:
                return rest
        calls = _calls_text(values, "parameters")
        return rest if calls is None else calls


def _split_objects(body: str) -> list[str]:
    """JSON objects written one after another, `;` or whitespace between them."""
    parts, at = [], 0
    while at < len(body):
        while at < len(body) and body[at] in "; \n\t\r":
            at += 1
        if at >= len(body):
            break
        if body[at] != "{":
            return [body]  # not objects: the caller's json.loads rejects it
        end = json_end(body, at)
        if end is None:
            return [body]
        parts.append(body[at:end])
        at = end
    return parts


def native_calls(parser: str | None) -> NativeCalls | None:
    """The translator of a parser name; None for the Hermes format (or no name).
    ValueError for an unknown name."""
    if parser in (None, "hermes", "qwen3"):
        return None
    if parser == "llama3_json":
        return Llama3Calls()
    if parser == "mistral":
        return MistralCalls()
    if parser == "phi4_mini_json":
        return MarkerCalls(_PHI)
    raise ValueError(f"unknown tool-call parser {parser!r}; known: {', '.join(TOOL_CALL_PARSERS)}")


#: Tell-tale text of each family's chat template -> its parser, first match wins.
_TEMPLATE_SIGNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(re.escape(_MISTRAL)), "mistral"),
    (re.compile(re.escape(_PYTHON_TAG) + r"|<\|start_header_id\|>[\s\S]*\"parameters\""),
     "llama3_json"),
    (re.compile(r"functools\[|<\|tool\|>"), "phi4_mini_json"),
)


def detect_tool_parser(chat_template: str | None) -> str:
    """The tool-call parser a chat template implies: Hermes unless it shows another
    family's syntax."""
    for sign, parser in _TEMPLATE_SIGNS:
        if chat_template and sign.search(chat_template):
            return parser
    return "hermes"
