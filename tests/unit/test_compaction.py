"""The compaction item of POST /v1/responses/compact: its content reads back as the
summary it carries, in the prompt of a request that sends it back; one this server did
not write is a 400 naming it; `split` keeps the conversation's last turn."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tokenyard.api.errors import parse_body
from tokenyard.api.responses.compact import CompactRequest, split
from tokenyard.api.responses.compaction import (
    SUMMARY_HEADER,
    compaction_item,
    decode_summary,
    encode_summary,
)
from tokenyard.api.responses.convert import item_messages, parse_items
from tokenyard.api.responses.schemas import ResponsesRequest
from tokenyard.errors import APIError


def test_a_summary_survives_its_encoding() -> None:
    text = "Ada likes green tea; she asked for a 3-day plan. Ünïcödé stays."
    assert decode_summary(encode_summary(text)) == text
    item = compaction_item(text)
    assert item["id"].startswith("cmp_") and item["type"] == "compaction"


def test_a_compaction_item_sent_back_becomes_a_system_summary_in_the_prompt() -> None:
    req = ResponsesRequest.model_validate({"model": "m", "input": [
        compaction_item("The user is Ada."), {"role": "user", "content": "Who am I?"}]})
    messages = item_messages(list(req.input), None, None)
    assert messages[0] == {"role": "system", "content": f"{SUMMARY_HEADER}\nThe user is Ada."}
    assert messages[1]["role"] == "user"


@pytest.mark.parametrize("content", ["plain text", "tyc1.%%%", "tyc1." + "e30="])
def test_content_this_server_did_not_write_is_refused_naming_it(content: str) -> None:
    body = {"model": "m", "input": [{"role": "user", "content": "hi"},
                                    {"type": "compaction", "encrypted_content": content}]}
    with pytest.raises(APIError) as refused:
        parse_body(ResponsesRequest, json.dumps(body).encode())
    assert (refused.value.status, refused.value.param) == (400, "input.1.encrypted_content")


def test_split_keeps_the_last_turn_and_summarises_the_rest() -> None:
    items = parse_items([
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
        {"role": "user", "content": "d"}, {"role": "assistant", "content": "e"}])
    older, recent = split(items)
    assert len(older) == 4 and len(recent) == 2
    assert split(items[:2]) == ([], items[:2])


def test_a_compact_request_needs_something_to_compact_and_knows_its_fields() -> None:
    with pytest.raises(ValidationError):
        CompactRequest.model_validate({"model": "m"})
    with pytest.raises(ValidationError):
        CompactRequest.model_validate({"model": "m", "input": "x", "bogus": 1})
    assert CompactRequest.model_validate({"model": "m", "previous_response_id": "resp_1"})
