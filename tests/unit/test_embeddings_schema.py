"""The /v1/embeddings body (every input shape OpenAI takes; client faults as 400s naming
the parameter) and the embeddings wire format between the HTTP process and the replica."""

from __future__ import annotations

import json
import struct

import pytest

from tokenyard.api.errors import parse_body
from tokenyard.api.openai.embeddings import EmbeddingRequest
from tokenyard.errors import APIError
from tokenyard.wire.embeddings import (
    EmbeddingsInfo,
    EmbedRequest,
    EmbedResult,
    EmbedStats,
    pack_floats,
    unpack_floats,
)
from tokenyard.wire.protocol import ProtocolError


def _parse(body: dict[str, object]) -> EmbeddingRequest:
    return parse_body(EmbeddingRequest, json.dumps(body))


@pytest.mark.parametrize("value,texts,ids", [
    ("hi", ["hi"], None),
    (["a", "b"], ["a", "b"], None),
    ([101, 7592, 102], None, [[101, 7592, 102]]),
    ([[101, 102], [101, 7592, 102]], None, [[101, 102], [101, 7592, 102]]),
])
def test_every_input_shape_openai_takes_is_read_as_a_list_of_inputs(
    value: object, texts: list[str] | None, ids: list[list[int]] | None
) -> None:
    req = _parse({"model": "m", "input": value})
    assert req.inputs() == (texts, ids)
    assert req.encoding_format == "float"


def test_a_null_encoding_format_is_the_default() -> None:
    """litellm sends `"encoding_format": null`; OpenAI reads it as not given (floats)."""
    assert _parse({"model": "m", "input": "x", "encoding_format": None}).encoding_format in (
        None, "float")


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": ""}, "input"),
    ({"model": "m", "input": ["ok", ""]}, "input.1"),
    ({"model": "m", "input": [[101], []]}, "input.1"),
    ({"model": "m", "input": [1, "a"]}, "input.0"),
    ({"model": "m", "input": [True]}, "input.0"),
    ({"model": "m", "input": ["x"] * 2049}, "input"),
    ({"model": "m", "input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"model": "m", "input": "x", "dimensions": 0}, "dimensions"),
    ({"model": "m", "input": "x", "truncate": True}, "truncate"),
    ({"input": "x"}, "model"),
])
def test_a_client_fault_is_a_400_naming_the_parameter(body: dict[str, object],
                                                      param: str) -> None:
    with pytest.raises(APIError) as caught:
        _parse(body)
    assert caught.value.status == 400
    assert caught.value.param == param, caught.value


def test_vectors_cross_the_wire_as_little_endian_float32() -> None:
    raw = struct.pack("<3f", 0.5, -1.25, 3.0)
    text = pack_floats(raw)
    assert unpack_floats(text) == [0.5, -1.25, 3.0]
    result = EmbedResult.from_json(EmbedResult([text], [3], 1.5, 2.0).to_json(), 1)
    assert (result.vector(0), result.prompt_tokens, result.queue_ms) == (
        [0.5, -1.25, 3.0], 3, 1.5)
    with pytest.raises(ProtocolError):
        EmbedResult.from_json({"embeddings": [text], "num_tokens": [3]}, 2)


@pytest.mark.parametrize("body,param", [
    ({"request_id": "r"}, "input_ids"),
    ({"request_id": "r", "input_ids": [[1]], "texts": ["a"]}, "input_ids"),
    ({"request_id": "r", "input_ids": []}, "input_ids"),
    ({"request_id": "r", "input_ids": [[1], []]}, "input_ids"),
    ({"request_id": "r", "input_ids": [[1.5]]}, "input_ids.0"),
    ({"request_id": "r", "texts": ["a", ""]}, "texts.1"),
    ({"input_ids": [[1]]}, "request_id"),
])
def test_the_replica_refuses_a_malformed_request_naming_the_field(
    body: dict[str, object], param: str
) -> None:
    with pytest.raises(ProtocolError) as caught:
        EmbedRequest.from_json(body)
    assert caught.value.param == param


def test_requests_info_and_stats_round_trip() -> None:
    for request in (EmbedRequest("r", [[101, 102]]), EmbedRequest("r", ["a", "b"])):
        assert EmbedRequest.from_json(request.to_json()) == request
    info = EmbeddingsInfo("all-minilm-l6-v2", 384, 256, 30522, 64)
    assert EmbeddingsInfo.from_json({**info.to_json(), "newer": 1}) == info
    stats = EmbedStats(requests=3, forward_passes=2)
    assert EmbedStats.from_json(stats.to_json()) == stats
