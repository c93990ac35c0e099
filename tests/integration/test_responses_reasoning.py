"""A reasoning model's thinking through POST /v1/responses: a scripted replica writes
Qwen3's `<think>` block (tokenizer ids, as an engine streams them); the response's output
is a reasoning item (its text a `reasoning_text` part) ahead of the message, its tokens
counted in `output_tokens_details.reasoning_tokens`, whole and streamed, every body and
event valid against Open Responses and parsed by the openai SDK's models. A reasoning
item sent back as input is accepted and left out of the prompt."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from openai.types.responses import ResponseOutputMessage, ResponseReasoningItem

from tests.conformance.test_responses import _event_components, _open, _resolved, valid_response
from tests.integration.test_family_tool_http import THINKING, _ask, _events, _reasoning_tokens

THOUGHT = "\nThe user asks for 6 times 7; that is 42.\n"
ANSWER = "\nIt is 42."


def _respond(body: dict[str, Any], reasoning: str = "qwen3") -> tuple[int, bytes]:
    return asyncio.run(_ask(THINKING, "auto", "/v1/responses",
                            {"model": "scripted", **body}, reasoning))


def test_the_thinking_is_a_reasoning_item_ahead_of_the_message() -> None:
    status, raw = _respond({"input": "6*7?"})
    assert status == 200, raw
    reply = valid_response(json.loads(raw), "reasoning response")
    kinds = [item["type"] for item in reply["output"]]
    assert kinds == ["reasoning", "message"]
    thought, message = reply["output"]
    ResponseReasoningItem.model_validate(thought)  # the SDK's own models take them
    ResponseOutputMessage.model_validate(message)
    assert thought["id"].startswith("rs_") and thought["summary"] == []
    assert thought["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert thought["status"] == message["status"] == "completed"
    assert message["content"][0]["text"] == ANSWER
    details = reply["usage"]["output_tokens_details"]
    assert details["reasoning_tokens"] == _reasoning_tokens(THINKING)
    assert 0 < details["reasoning_tokens"] < reply["usage"]["output_tokens"]


def test_streamed_the_reasoning_item_comes_first_with_its_own_events() -> None:
    status, raw = _respond({"input": "6*7?", "stream": True})
    assert status == 200, raw
    components = _event_components()
    events = _events(raw)
    for event in events:
        assert event["type"] in components, f"no schema for {event['type']}"
        _open().validate(_resolved(event, event["type"]), components[event["type"]],
                         event["type"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning.delta") < kinds.index("response.reasoning.done") \
        < first_text
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    parts = [e["part"]["type"] for e in events if e["type"] == "response.content_part.added"]
    assert parts == ["reasoning_text", "output_text"]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning.delta")
    done = next(e for e in events if e["type"] == "response.reasoning.done")
    assert thought == done["text"] == THOUGHT
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert answer == ANSWER
    final = valid_response(events[-1]["response"], "streamed reasoning response")
    assert events[-1]["type"] == "response.completed"
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == THOUGHT
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == \
        _reasoning_tokens(THINKING)


def test_without_a_reasoning_parser_the_thinking_stays_in_the_message() -> None:
    status, raw = _respond({"input": "6*7?"}, reasoning="none")
    assert status == 200, raw
    reply = json.loads(raw)
    assert [item["type"] for item in reply["output"]] == ["message"]
    assert reply["output"][0]["content"][0]["text"] == THINKING
    assert reply["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


def test_a_reasoning_item_sent_back_is_accepted_and_not_prompted() -> None:
    earlier = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "x" * 4000}]}
    turn = [{"role": "user", "content": "6*7?"}, earlier,
            {"role": "assistant", "content": "42"}, {"role": "user", "content": "Sure?"}]
    status, raw = _respond({"input": turn})
    assert status == 200, raw
    without = [item for item in turn if item is not earlier]
    status, plain = _respond({"input": without})
    assert status == 200, plain
    assert json.loads(raw)["usage"]["input_tokens"] == json.loads(plain)["usage"]["input_tokens"]
