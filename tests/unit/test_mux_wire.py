"""The multiplexed channel's messages (`wire/mux.py`): what the replica encodes the HTTP
side decodes to the same deltas, refusals and failures."""

from __future__ import annotations

import math

import pytest

from tokenyard.wire.mux import (
    ABORT_OP,
    GENERATE_OP,
    Failure,
    Refusal,
    abort_op,
    decode_frame,
    encode_frame,
    generate_op,
    read_op,
)
from tokenyard.wire.protocol import CoreDelta, GenerateRequest, ProtocolError, TokenLogprob
from tokenyard.wire.sampling_params import SamplingParams


def delta(request_id: str, tokens: list[int], **kw: object) -> CoreDelta:
    fields: dict[str, object] = dict(new_logprobs=None, finish_reason=None, stop_reason=None,
                                     num_prompt_tokens=3, num_cached_tokens=0)
    fields.update(kw)
    return CoreDelta(request_id, tokens, **fields)  # type: ignore[arg-type]


def test_a_frame_carries_every_requests_delta_of_a_step_and_decodes_to_them() -> None:
    outs = [delta("a", [5]), delta("b", [6], finish_reason="length"),
            delta("c", [7], queue_time=0.25, prefill_time=0.5)]
    frame = decode_frame(encode_frame((d.request_id, d) for d in outs))
    assert frame.deltas == outs and frame.refused == [] and frame.failed == []


def test_a_logprob_of_minus_infinity_survives_the_frame() -> None:
    out = delta("a", [5], new_logprobs=[TokenLogprob(-math.inf, [(5, -math.inf), (6, -1.5)])])
    (back,) = decode_frame(encode_frame([("a", out)])).deltas
    assert back.new_logprobs is not None and back.new_logprobs[0].logprob == -math.inf
    assert back.new_logprobs[0].top == [(5, -math.inf), (6, -1.5)]


def test_refusals_and_failures_travel_with_the_deltas() -> None:
    refused = Refusal("r", 503, {"message": "busy", "param": None, "code": "overloaded"}, 1.0)
    failed = Failure("f", {"message": "engine step failed", "code": "engine_error"})
    frame = decode_frame(encode_frame([], [refused], [failed]))
    assert frame.refused == [refused] and frame.failed == [failed]


def test_the_http_sides_messages_read_back() -> None:
    request = GenerateRequest("id-1", [1, 2, 3], SamplingParams(max_tokens=4), "salt", 2)
    op, message = read_op(generate_op(request, "00-abc-def-01"))
    assert op == GENERATE_OP and message["traceparent"] == "00-abc-def-01"
    assert GenerateRequest.from_json(message["request"]) == request
    assert read_op(abort_op("id-1")) == (ABORT_OP, {"op": ABORT_OP, "request_id": "id-1"})


@pytest.mark.parametrize("raw", [b"not json", b"[]", b'{"op": "launch"}',
                                 b'{"op": "abort", "request_id": 7}'])
def test_a_malformed_message_is_a_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        read_op(raw)


@pytest.mark.parametrize("raw", [b"nope", b'{"deltas": [{"new_token_ids": [1]}]}',
                                 b'{"deltas": [{"request_id": "a", "new_token_ids": [1.5]}]}'])
def test_a_malformed_frame_is_a_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_frame(raw)
