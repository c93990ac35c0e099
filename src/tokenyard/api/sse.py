"""Server-sent events: encoders for both APIs' streams and an incremental parser.

OpenAI streams are bare ``data: {json}`` events ending with ``data: [DONE]``; an error after
the stream began is ``data: {"error": {...}}``. Anthropic streams name every event
(``event: content_block_delta``) and carry the same name as the payload's ``type``; an error is
``event: error``. JSON is compact (no spaces) and UTF-8 (not ASCII-escaped).

`SSEParser` decodes a byte stream split at arbitrary boundaries (mid-line, mid-character,
between ``\\r`` and ``\\n``) per the WHATWG event-stream rules; tests and the benchmark client
use it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel

from tokenyard.api.errors import anthropic_error_body, openai_error_body
from tokenyard.errors import APIError

#: The OpenAI stream's terminator.
SSE_DONE = b"data: [DONE]\n\n"
#: Headers every SSE response carries (no proxy buffering, no caching).
SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}


def to_json(obj: Any) -> bytes:
    """Compact UTF-8 JSON of a pydantic model or of plain JSON data."""
    if isinstance(obj, BaseModel):
        return obj.__pydantic_serializer__.to_json(obj)
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # an integer beyond 64 bits (the OpenAPI document's bounds)
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse_data(obj: Any) -> bytes:
    """``data: {json}\\n\\n``: one unnamed event (OpenAI)."""
    return b"data: " + to_json(obj) + b"\n\n"


def sse_event(event: str, obj: Any) -> bytes:
    """``event: name\\ndata: {json}\\n\\n``: one named event (Anthropic)."""
    if "\n" in event or "\r" in event:
        raise ValueError("an SSE event name cannot contain a line break")
    return b"event: " + event.encode("utf-8") + b"\ndata: " + to_json(obj) + b"\n\n"


def anthropic_event(model: BaseModel) -> bytes:
    """An Anthropic stream event named after its payload's `type` field."""
    return sse_event(str(getattr(model, "type")), model)  # noqa: B009


def openai_stream_error(err: APIError) -> bytes:
    """An error after an OpenAI stream began: ``data: {"error": {...}}`` (the SDK raises it)."""
    return sse_data(openai_error_body(err))


def anthropic_stream_error(err: APIError, request_id: str | None = None) -> bytes:
    """An error after an Anthropic stream began: ``event: error`` (the SDK raises it)."""
    return sse_event("error", anthropic_error_body(err, request_id))


# ---------------------------------------------------------------------------- parser


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event: `event` is None for unnamed ones (OpenAI's)."""

    event: str | None
    data: str
    id: str | None = None
    retry: int | None = None

    @property
    def is_done(self) -> bool:
        """Whether this is OpenAI's ``[DONE]`` terminator."""
        return self.data == "[DONE]"

    def json(self) -> Any:
        """`data` parsed as JSON."""
        return json.loads(self.data)


class SSEParser:
    """Incremental event-stream parser: `feed` bytes as they arrive, collect events.

    Lines may end in LF, CRLF or CR, also when a CR and its LF arrive in different pieces;
    UTF-8 characters may be split between pieces; a leading byte-order mark is skipped.
    Comment lines and unknown fields are ignored; an event with no data lines is not
    dispatched (per the WHATWG rules).
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._pending_cr = False  # the previous piece ended in CR: a LF next is its pair
        self._started = False
        self._event: str | None = None
        self._data: list[str] = []
        self._last_id: str | None = None
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume `chunk`; return the events it completed."""
        events: list[SSEEvent] = []
        if not chunk:
            return events
        if self._pending_cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._pending_cr = False
        self._buffer += chunk
        if not self._started:
            if len(self._buffer) < 3 and b"\xef\xbb\xbf".startswith(bytes(self._buffer)):
                return events  # maybe the start of a BOM: wait for more
            if self._buffer.startswith(b"\xef\xbb\xbf"):
                del self._buffer[:3]
            self._started = True
        start = 0
        buf = self._buffer
        size = len(buf)
        while True:
            lf = buf.find(b"\n", start)
            cr = buf.find(b"\r", start, lf if lf >= 0 else size)
            if cr >= 0:
                end, nxt = cr, cr + 1
                if nxt < size and buf[nxt] == 0x0A:
                    nxt += 1
                elif nxt == size:
                    self._pending_cr = True
            elif lf >= 0:
                end, nxt = lf, lf + 1
            else:
                break
            event = self._line(bytes(buf[start:end]).decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
            start = nxt
        del buf[:start]
        return events

    def finish(self) -> list[SSEEvent]:
        """End of stream: an event not closed by a blank line is discarded (WHATWG rules)."""
        self._buffer.clear()
        self._pending_cr = False
        self._event, self._data, self._retry = None, [], None
        return []

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event, retry = self._data, self._event, self._retry
        self._data, self._event, self._retry = [], None, None
        if not data:
            return None
        return SSEEvent(event=event or None, data="\n".join(data), id=self._last_id, retry=retry)


def parse_sse(chunks: Iterable[bytes]) -> Iterator[SSEEvent]:
    """Events of a whole stream given as byte pieces."""
    parser = SSEParser()
    for chunk in chunks:
        yield from parser.feed(chunk)
    yield from parser.finish()
