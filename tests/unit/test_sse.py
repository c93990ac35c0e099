"""SSE encoders and the incremental parser: round trips over arbitrary split points."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import BaseModel

from tokenyard.api.sse import (
    SSE_DONE,
    SSEEvent,
    SSEParser,
    anthropic_event,
    anthropic_stream_error,
    openai_stream_error,
    parse_sse,
    sse_data,
    sse_event,
    to_json,
)
from tokenyard.errors import APIError


class Piece(BaseModel):
    type: str = "content_block_delta"
    text: str


def test_encoders_are_compact_and_utf8() -> None:
    assert sse_data({"a": [1, 2], "b": "é"}) == 'data: {"a":[1,2],"b":"é"}\n\n'.encode()
    assert sse_event("ping", {"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert sse_data(Piece(text="x y")) == b'data: {"type":"content_block_delta","text":"x y"}\n\n'
    assert anthropic_event(Piece(text="z")).startswith(b"event: content_block_delta\ndata: ")
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert to_json(Piece(text="\n")) == b'{"type":"content_block_delta","text":"\\n"}'
    with pytest.raises(ValueError):
        sse_event("bad\nname", {})


def test_error_events() -> None:
    err = APIError(503, "busy", code="server_is_overloaded")
    (event,) = parse_sse([openai_stream_error(err)])
    assert event.event is None and event.json()["error"]["message"] == "busy"
    (event,) = parse_sse([anthropic_stream_error(err, request_id="r1")])
    assert event.event == "error"
    assert event.json() == {"type": "error", "request_id": "r1",
                            "error": {"type": "overloaded_error", "message": "busy"}}


def _mixed_stream() -> tuple[bytes, list[SSEEvent]]:
    """Both APIs' events, with multi-byte text, newlines in data and comments."""
    rng = random.Random(7)
    words = ["héllo", "wörld", "日本語", "🙂", "a\nb", "\r", '"q"', "", " "]
    raw = b": keep-alive\n\n"
    expected: list[SSEEvent] = []
    for i in range(60):
        text = "".join(rng.choice(words) for _ in range(rng.randint(0, 4)))
        if i % 2:
            payload = {"choices": [{"delta": {"content": text}}]}
            raw += sse_data(payload)
            expected.append(SSEEvent(None, json.dumps(payload, separators=(",", ":"),
                                                      ensure_ascii=False)))
        else:
            piece = Piece(text=text)
            raw += anthropic_event(piece)
            expected.append(SSEEvent("content_block_delta", piece.model_dump_json()))
    raw += SSE_DONE
    expected.append(SSEEvent(None, "[DONE]"))
    return raw, expected


@pytest.mark.parametrize("seed", range(40))
def test_round_trip_over_random_split_points(seed: int) -> None:
    raw, expected = _mixed_stream()
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(raw)), rng.randint(1, 200)))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    assert list(parse_sse(pieces)) == expected


def test_byte_at_a_time() -> None:
    raw, expected = _mixed_stream()
    assert list(parse_sse(raw[i : i + 1] for i in range(len(raw)))) == expected


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_line_endings_split_anywhere(newline: bytes) -> None:
    raw = (b"\xef\xbb\xbfevent: a" + newline + b"data: 1" + newline + b"data:2" + newline
           + newline + b"id: 7" + newline + b"retry: 300" + newline + b"data: x" + newline
           + newline + b"data: unterminated")
    want = [SSEEvent("a", "1\n2"), SSEEvent(None, "x", id="7", retry=300)]
    for cut in range(1, len(raw)):
        for cut2 in range(cut, len(raw), 5):
            assert list(parse_sse([raw[:cut], raw[cut:cut2], raw[cut2:]])) == want, (cut, cut2)


def test_fields_and_edge_cases() -> None:
    parser = SSEParser()
    events = parser.feed(b"event: only-name\n\n")  # no data: not dispatched
    events += parser.feed(b"data\n\n")  # a field without colon: empty data line
    events += parser.feed(b"unknown: x\ndata:  two spaces\n\n")
    events += parser.feed(b"event: e\ndata: {}\n\n")
    assert events == [SSEEvent(None, ""), SSEEvent(None, " two spaces"), SSEEvent("e", "{}")]
    assert events[-1].json() == {}
    assert parser.finish() == []
