"""The Responses dialect's conversions: input items into template messages, the
request's refusals, the reply split into output items, and the stream's events."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_tokenizer import embedded_tokenizer
from tokenyard.api.errors import parse_body
from tokenyard.api.ops import openapi_document
from tokenyard.api.responses.convert import (
    finished,
    fitted_conversation,
    item_messages,
    items_json,
    output_items,
    parse_items,
    request_items,
    request_params,
    response_shell,
    tool_use,
)
from tokenyard.api.responses.objects import FunctionCallOutput, OutputMessage, response_usage
from tokenyard.api.responses.schemas import ResponsesRequest
from tokenyard.api.responses.stream import ResponsesFormat
from tokenyard.api.sse import parse_sse
from tokenyard.errors import APIError
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.prepare import Preparer
from tokenyard.text.tools import RESPONSE_OPEN, call_text
from tokenyard.wire.outputs import CompletionDelta, Logprob, RequestOutput

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _request(**fields: Any) -> ResponsesRequest:
    return parse_body(ResponsesRequest, json.dumps({"model": "m", **fields}))


def _refusal(**fields: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        _request(**fields)
    assert caught.value.status == 400
    return caught.value


def test_string_input_is_one_user_message_after_the_instructions() -> None:
    req = _request(input="Hi there", instructions="Be brief.")
    messages = item_messages(request_items(req), req.instructions, None)
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi there"}]


def test_message_items_join_text_parts_and_developer_becomes_system() -> None:
    req = _request(input=[
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
    ])
    messages = item_messages(request_items(req), None, None)
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", "Rules."), ("user", "a\nb"), ("assistant", "ok")]


def test_image_parts_keep_their_place_and_name_their_item() -> None:
    req = _request(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": "https://example.com/cat.png"}]}])
    [message] = item_messages(request_items(req), None, None)
    parts = message.get("parts")
    assert parts is not None and parts[0] == "What is this?"
    assert getattr(parts[1], "param") == "input.0.content.1"  # noqa: B009


def _round_trip_items() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
    ]


def test_calls_and_outputs_are_written_into_the_turns_for_a_plain_template() -> None:
    req = _request(input=_round_trip_items(), tools=[WEATHER])
    messages = item_messages(request_items(req), None, tool_use(req))
    # The output continues the turn that made the call: the reply goes on after it.
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert "get_weather" in messages[0]["content"]  # the tools' system prompt
    assert messages[2]["content"] == (call_text("get_weather", '{"city": "Paris"}')
                                      + f"\n{RESPONSE_OPEN}\nSunny\n</tool_response>\n")


def test_a_native_template_gets_tool_calls_and_tool_messages() -> None:
    req = _request(input=[{"role": "assistant", "content": "Let me look."},
                          *_round_trip_items()[1:]], tools=[WEATHER])
    messages = item_messages(request_items(req), None, tool_use(req), native=True)
    assert [m["role"] for m in messages] == ["assistant", "tool"]
    assert messages[0]["content"] == "Let me look."
    calls = messages[0].get("tool_calls")  # type: ignore[typeddict-item]
    assert calls == [{"type": "function", "function": {"name": "get_weather",
                                                       "arguments": {"city": "Paris"}}}]


def test_items_survive_storage_and_come_back_equal() -> None:
    req = _request(input=[*_round_trip_items(),
                          {"role": "user", "content": [{"type": "input_text", "text": "x"}]}])
    items = request_items(req)
    assert parse_items(json.loads(json.dumps(items_json(items)))) == items


def test_tool_choice_and_parallel_calls_become_the_tool_use() -> None:
    use = tool_use(_request(input="x", tools=[WEATHER], parallel_tool_calls=False,
                            tool_choice={"type": "function", "name": "get_weather"}))
    assert use is not None and use.choice.mode == "required"
    assert use.choice.name == "get_weather" and not use.choice.parallel
    assert tool_use(_request(input="x")) is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "web_search_preview"}]}, "tools.0.type"),
    ({"tools": [WEATHER, {"type": "code_interpreter", "container": {}}]}, "tools.1.type"),
    ({"background_options": {"x": 1}}, "background_options"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"top_k": 5}, "top_k"),  # frequency_penalty is honoured since issue 27
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input.0.content.0.file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input.0.content.0.image_url"),
    ({"input": [{"role": "assistant", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input.0.content.0.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
])
def test_what_cannot_be_served_is_refused_naming_the_field(fields: dict[str, Any],
                                                            param: str) -> None:
    assert _refusal(**{"input": "x", **fields}).param == param


def test_accepted_hints_have_no_effect_on_the_reply() -> None:
    req = _request(input="x", user="u", safety_identifier="s", prompt_cache_key="k",
                   service_tier="auto", truncation="auto", include=["reasoning.encrypted_content"],
                   reasoning={"effort": "none"}, store=False, metadata={"a": "b"})
    shell = response_shell(req, "m")
    assert shell.store is False and shell.metadata == {"a": "b"} and shell.truncation == "auto"
    assert request_params(req).max_tokens is None


def test_text_format_is_the_grammar_of_chat_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = request_params(_request(input="x", max_output_tokens=8, text={"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}}))
    assert params.max_tokens == 8 and params.guided is not None
    assert params.guided.kind == "json_schema" and json.loads(params.guided.spec) == schema
    assert params.guided.param == "text.format.schema"
    loose = request_params(_request(input="x", text={"format": {"type": "json_object"}}))
    assert loose.guided is not None and loose.guided.kind == "json_object"


def test_a_reply_splits_into_its_message_and_its_calls() -> None:
    use = tool_use(_request(input="x", tools=[WEATHER]))
    text = "Checking.\n" + call_text("get_weather", '{"city": "Oslo"}')
    message, call = output_items(text, use)
    assert isinstance(message, OutputMessage) and message.id.startswith("msg_")
    assert message.content[0].text == "Checking."
    assert isinstance(call, FunctionCallOutput) and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and call.arguments == '{"city": "Oslo"}'
    [only_call] = output_items(call_text("get_weather", "{}"), use)
    assert only_call.type == "function_call"
    [empty] = output_items("", None)
    assert isinstance(empty, OutputMessage) and empty.content[0].text == ""


def test_running_out_of_tokens_makes_the_response_incomplete() -> None:
    req = _request(input="x", max_output_tokens=4)
    response = response_shell(req, "m")
    response.output = output_items("Hello", None)
    finished(response, "length", response_usage(10, 4, 3))
    assert response.status == "incomplete" and response.output[0].status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.completed_at is None and response.usage is not None
    assert response.usage.total_tokens == 14
    assert response.usage.input_tokens_details.cached_tokens == 3


def _output(text: str, finish: str | None = None) -> RequestOutput:
    return RequestOutput("r", [CompletionDelta(0, text, [1], None, finish, None)],
                         finish is not None, 10, 0, 1)


def test_stream_events_come_in_order_with_increasing_sequence_numbers() -> None:
    req = _request(input="x", tools=[WEATHER])
    fmt = ResponsesFormat(response_shell(req, "m"), tool_use(req))
    events = [*fmt.head(), *fmt.events(0, _output("Sure. ")),
              *fmt.events(0, _output(call_text("get_weather", '{"city": "Rome"}'), "stop"))]
    kinds = [e.type for e in events]  # type: ignore[attr-defined]
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    assert kinds[5:8] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done"]
    assert kinds[8] == "response.output_item.added"
    assert kinds[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))  # type: ignore[attr-defined]
    deltas = "".join(e.delta for e in events  # type: ignore[attr-defined]
                     if e.type == "response.function_call_arguments.delta")  # type: ignore[attr-defined]
    assert json.loads(deltas) == {"city": "Rome"}
    message, call = fmt.response.output
    assert message.status == "completed" and call.status == "completed"
    assert isinstance(call, FunctionCallOutput) and call.arguments == deltas


def test_the_openapi_document_describes_the_route() -> None:
    doc = openapi_document()
    post = doc["paths"]["/v1/responses"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ResponsesRequest")
    assert {"ResponsesRequest", "ResponseObject"} <= set(doc["components"]["schemas"])


def test_a_stream_that_fails_after_its_200_ends_with_response_failed() -> None:
    fmt = ResponsesFormat(response_shell(_request(input="x"), "m"), None)
    sent = [*fmt.head(), *fmt.events(0, _output("Hel"))]
    [event] = parse_sse([fmt.error(APIError(500, "The replica went away."))])
    assert event.event == "response.failed"
    body = event.json()
    assert body["sequence_number"] == len(sent)
    assert body["response"]["status"] == "failed" and fmt.final is None
    assert body["response"]["error"] == {"code": "server_error",
                                         "message": "The replica went away."}
    assert body["response"]["output"][0]["content"][0]["text"] == "Hel"


def test_range_errors_name_max_output_tokens() -> None:
    with pytest.raises(APIError) as caught:
        request_params(_request(input="x", max_output_tokens=0))
    assert caught.value.param == "max_output_tokens"


def test_truncation_auto_drops_the_oldest_items_until_the_prompt_fits(
        embedded_gguf_path: Path) -> None:
    prepare = Preparer(embedded_tokenizer(embedded_gguf_path), 160)
    turns = [{"role": role, "content": f"Turn {i}: " + "lorem ipsum dolor " * 6}
             for i, role in enumerate(["user", "assistant"] * 3)]
    req = _request(input=turns, instructions="Be brief.", max_output_tokens=16)
    kwargs: dict[str, Any] = dict(instructions=req.instructions, use=None, native=False,
                                  first_index=0, param="input", timeline=Timeline())
    with pytest.raises(APIError) as caught:
        fitted_conversation(prepare, request_items(req), request_params(req),
                            truncate=False, **kwargs)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "input"
    messages, prompt, params = fitted_conversation(prepare, request_items(req),
                                                   request_params(req), truncate=True, **kwargs)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    kept = [m["content"][:6] for m in messages[1:]]
    assert 1 <= len(kept) < len(turns) and kept[-1] == "Turn 5"
    assert kept == [t["content"][:6] for t in turns[-len(kept):]]  # the newest, in order
    assert params.max_tokens is not None and len(prompt) + params.max_tokens <= 160
    # One item more would not have fitted.
    longer = item_messages(request_items(req)[-len(kept) - 1:], req.instructions, None)
    assert len(prepare.conversation(longer, Timeline(), prefill=False)) + 16 > 160


def test_logprobs_are_asked_for_by_include_or_top_logprobs() -> None:
    asked = _request(input="x", include=["message.output_text.logprobs"])
    assert request_params(asked).logprobs == 0
    assert request_params(_request(input="x", top_logprobs=3)).logprobs == 3
    assert request_params(_request(input="x", include=["reasoning.encrypted_content"])
                          ).logprobs is None
    assert _refusal(input="x", top_logprobs=21).param == "top_logprobs"


def test_streamed_logprobs_ride_on_the_text_deltas_and_sum_up_in_the_part() -> None:
    fmt = ResponsesFormat(response_shell(_request(input="x", top_logprobs=1), "m"), None,
                          lambda token: f"<{token}>".encode())

    def step(text: str, token: int, finish: str | None = None) -> RequestOutput:
        entry = Logprob(token, -0.5, [(token, -0.5)])
        return RequestOutput("r", [CompletionDelta(0, text, [token], [entry], finish, None)],
                             finish is not None, 3, 0, 1)

    events = [*fmt.events(0, step("", 7)), *fmt.events(0, step("a", 8)),
              *fmt.events(0, step("", 9, "stop"))]
    [delta] = [e for e in events if e.type == "response.output_text.delta"]  # type: ignore[attr-defined]
    # The first token's text was held back: its logprob goes out with the next text.
    assert [lp.token for lp in delta.logprobs] == ["<7>", "<8>"]  # type: ignore[attr-defined]
    [done] = [e for e in events if e.type == "response.output_text.done"]  # type: ignore[attr-defined]
    assert [lp.token for lp in done.logprobs] == ["<7>", "<8>", "<9>"]  # type: ignore[attr-defined]
    assert done.logprobs[0].top_logprobs[0].bytes == list(b"<7>")  # type: ignore[attr-defined]


def test_stored_items_that_cannot_be_read_back_are_a_400_not_a_500() -> None:
    with pytest.raises(APIError) as caught:
        parse_items([{"type": "function_call", "call_id": "c"}])
    assert caught.value.status == 400 and caught.value.param == "0.name"
