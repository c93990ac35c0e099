"""POST /v1/responses through the official `openai` SDK against `tokenyard serve`:
plain and streamed responses, structured output, a tool loop, and refusals."""

from __future__ import annotations

import json
import uuid
from typing import Any

import openai
import pydantic
import pytest

from tests.e2e.conftest import Server

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function", "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False},
    "strict": True,
}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                         max_retries=0)


def test_string_input_gets_a_message_and_its_usage(client: openai.OpenAI,
                                                   server: Server) -> None:
    r = client.responses.create(model=server.model, input="Say hello.", max_output_tokens=8,
                                temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == server.model
    assert r.status in ("completed", "incomplete") and r.error is None
    [message] = r.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert r.output_text == message.content[0].text and r.output_text
    assert r.usage is not None and 0 < r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.max_output_tokens == 8 and r.tools == [] and r.tool_choice == "auto"


def test_instructions_and_list_input_make_the_prompt_chat_would(client: openai.OpenAI,
                                                               server: Server) -> None:
    rule = "Answer in one word."
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "Name a color."}]
    items = [*turns[:2], {"role": "user", "content": [
        {"type": "input_text", "text": "Name a color."}]}]
    told = client.responses.create(model=server.model, input=items, instructions=rule,
                                   max_output_tokens=1)
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "system", "content": rule}, *turns],
        max_tokens=1)
    assert told.usage is not None and chat.usage is not None
    assert told.usage.input_tokens == chat.usage.prompt_tokens
    assert told.instructions == rule
    developer = client.responses.create(
        model=server.model, input=[{"role": "developer", "content": rule}, *items],
        max_output_tokens=1)
    assert developer.usage is not None
    assert developer.usage.input_tokens == told.usage.input_tokens


def test_a_repeated_prompt_reports_cached_tokens(client: openai.OpenAI,
                                                 server: Server) -> None:
    prompt = "Repeat after me: " + " ".join(f"word{i}" for i in range(40))
    first = client.responses.create(model=server.model, input=prompt, max_output_tokens=1)
    again = client.responses.create(model=server.model, input=prompt, max_output_tokens=1)
    assert first.usage is not None and again.usage is not None
    assert again.usage.input_tokens == first.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens >= 32


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI, server: Server) -> None:
    r = client.responses.create(model=server.model, input="Tell me a long story.",
                                max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 2
    assert r.output[0].status == "incomplete"


def test_stream_events_are_in_order_and_the_deltas_make_the_text(client: openai.OpenAI,
                                                                 server: Server) -> None:
    with client.responses.stream(model=server.model, input="Count from one to ten.",
                                 max_output_tokens=12, temperature=0) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")  # sampled: may stop
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas and final.output_text == deltas
    assert final.id == events[0].response.id  # type: ignore[union-attr]
    assert final.usage is not None and 0 < final.usage.output_tokens <= 12
    assert (final.status == "incomplete") == (kinds[-1] == "response.incomplete")


def test_logprobs_come_per_token_streamed_or_not(client: openai.OpenAI,
                                                 server: Server) -> None:
    kwargs: dict[str, Any] = dict(model=server.model, input="Say hello.", max_output_tokens=4,
                                  temperature=0, top_logprobs=2,
                                  include=["message.output_text.logprobs"])
    r = client.responses.create(**kwargs)
    part = r.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    assert r.usage is not None and len(part.logprobs) == r.usage.output_tokens
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    assert r.top_logprobs == 2
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    streamed = [lp.token for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert streamed == [lp.token for lp in part.logprobs]


def test_parse_fills_a_pydantic_model_from_a_strict_schema(client: openai.OpenAI,
                                                           server: Server) -> None:
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=120)

    r = client.responses.parse(model=server.model, input="Invent a person.",
                               text_format=Person, max_output_tokens=40, temperature=0)
    assert r.status == "completed" and isinstance(r.output_parsed, Person)
    assert r.text is not None and r.text.format is not None
    assert r.text.format.type == "json_schema"


def test_json_object_format_gives_a_json_object(client: openai.OpenAI,
                                                server: Server) -> None:
    # A prompt SmolLM2 closes in a few tokens at temperature 0 ({"capital": "Paris"}).
    r = client.responses.create(model=server.model,
                                input='Give the capital of France as JSON: {"capital": ...}',
                                text={"format": {"type": "json_object"}},
                                max_output_tokens=48, temperature=0)
    assert r.status == "completed", f"the object did not close in 48 tokens: {r.output_text!r}"
    assert isinstance(json.loads(r.output_text), dict)
    assert r.text is not None and r.text.format is not None
    assert r.text.format.type == "json_object"


def test_a_tool_call_and_its_output_lead_to_a_message(client: openai.OpenAI,
                                                      server: Server) -> None:
    first = client.responses.create(model=server.model, input=ASK, tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=40, temperature=0)
    assert first.status == "completed"
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.id is not None and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    history = [{"role": "user", "content": ASK},
               *[o.model_dump(exclude_none=True) for o in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    second = client.responses.create(model=server.model, input=history, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=16, temperature=0)
    assert [o.type for o in second.output] == ["message"] and second.output_text
    # The call and its result are in the prompt (the tools are not: tool_choice "none").
    bare = client.responses.create(model=server.model, input=ASK, max_output_tokens=1)
    assert second.usage is not None and bare.usage is not None
    assert second.usage.input_tokens > bare.usage.input_tokens + 20


@pytest.mark.parametrize("fields", [
    {"tool_choice": "auto"}, {"tool_choice": "auto", "tools": []},
    {"tool_choice": "none", "tools": []},
])
def test_tool_choice_without_tools_is_accepted_and_has_no_effect(
        client: openai.OpenAI, server: Server, fields: dict[str, Any]) -> None:
    # LlamaIndex and others always send tool_choice, tools or not.
    r = client.responses.create(model=server.model, input="Say hello.", max_output_tokens=4,
                                temperature=0, **fields)
    assert [o.type for o in r.output] == ["message"] and r.output_text
    assert r.tools == [] and r.tool_choice == fields["tool_choice"]


def test_a_named_tool_streams_its_arguments(client: openai.OpenAI, server: Server) -> None:
    with client.responses.stream(model=server.model, input=ASK, tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 parallel_tool_calls=False, max_output_tokens=40,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    streamed = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
    [call] = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == streamed and json.loads(streamed)["city"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"background": True, "store": False}, "store"),
    ({"seed": 3}, "seed"),
    ({"reasoning": {"effort": "medium"}}, "reasoning"),
    # The replica's grammar compiler refuses it, naming the Responses field.
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"not": {"type": "string"}}}}}, "text.format.schema"),
    # No deployment here has vision.
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input.0.content.1"),
])
def test_what_cannot_be_served_is_a_400_naming_it(client: openai.OpenAI, server: Server,
                                                  fields: dict[str, object],
                                                  param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=server.model, max_output_tokens=1,
                                extra_body={"input": "Hi.", **fields})
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == param


def test_previous_response_id_chains_turns_and_their_prefix_is_cached(
        client: openai.OpenAI, server: Server) -> None:
    first = client.responses.create(model=server.model, max_output_tokens=8,
                                    instructions="You are a terse assistant.",
                                    input="My name is Ada and I live in a small town.")
    # Streamed: the response is stored before the stream's last event reaches us.
    with client.responses.stream(model=server.model, input="What is my name?",
                                 previous_response_id=first.id,
                                 max_output_tokens=8) as stream:
        second = [e for e in stream][-1].response  # type: ignore[union-attr]
    third = client.responses.create(model=server.model, input="And where do I live?",
                                    previous_response_id=second.id, max_output_tokens=8)
    turns = [first, second, third]
    usage = [r.usage for r in turns]
    assert all(u is not None for u in usage)
    inputs = [u.input_tokens for u in usage if u is not None]
    cached = [u.input_tokens_details.cached_tokens for u in usage if u is not None]
    # Each turn's prompt holds the turns before it, so it grows and so does the part of
    # it the prefix cache already holds.
    assert inputs[0] < inputs[1] < inputs[2]
    assert cached[0] < cached[1] < cached[2] and cached[1] >= 16
    assert third.previous_response_id == second.id
    stored = client.responses.retrieve(third.id)
    assert stored.output_text == third.output_text and stored.usage == third.usage


def test_an_unstored_or_unknown_response_cannot_be_continued(client: openai.OpenAI,
                                                             server: Server) -> None:
    unstored = client.responses.create(model=server.model, input="Hi.", max_output_tokens=1,
                                       store=False)
    assert unstored.store is False
    for previous in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=server.model, input="Again.", max_output_tokens=1,
                                    previous_response_id=previous)
        body = caught.value.body
        assert isinstance(body, dict) and body["param"] == "previous_response_id"
        assert body["code"] == "previous_response_not_found"


def test_an_idempotency_key_replays_the_response(client: openai.OpenAI,
                                                 server: Server) -> None:
    key = {"Idempotency-Key": f"responses-{uuid.uuid4().hex}"}
    kwargs: dict[str, Any] = dict(model=server.model, input="Say hello.", max_output_tokens=4,
                                  extra_headers=key)
    first = client.responses.with_raw_response.create(**kwargs)
    again = client.responses.with_raw_response.create(**kwargs)
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.parse().id == first.parse().id
