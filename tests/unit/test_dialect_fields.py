"""Every request field the installed SDKs document is known to the request schemas:
honoured, accepted without effect, or refused with a 400 naming it; a field no SDK
documents is a 400 naming it. Response bodies carry the fields the SDKs' models have.

The SDKs' own `*_create_params` TypedDicts are the list of documented fields, so an SDK
upgrade that adds one fails here until the schemas decide what to do with it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.types import Message
from anthropic.types import message_count_tokens_params as claude_count
from anthropic.types import message_create_params as claude_create
from anthropic.types.beta import message_count_tokens_params as claude_beta_count
from anthropic.types.beta import message_create_params as claude_beta_create
from openai.types import completion_create_params as legacy_create
from openai.types.chat import ChatCompletion
from openai.types.chat import completion_create_params as chat_create
from openai.types.responses import response_create_params as responses_create

from tokenyard.api.anthropic.convert import anthropic_request_to_engine, build_anthropic_message
from tokenyard.api.anthropic.request_fields import REFUSED
from tokenyard.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from tokenyard.api.errors import parse_body, render_anthropic
from tokenyard.api.openai.convert import build_chat_completion, chat_request_to_engine
from tokenyard.api.openai.platform_fields import CHAT_UNSUPPORTED
from tokenyard.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from tokenyard.api.openai.stream import ChatStream
from tokenyard.api.responses.convert import request_params, text_grammar, tool_use
from tokenyard.api.responses.schemas import RESPONSES_UNSUPPORTED, ResponsesRequest
from tokenyard.errors import APIError
from tokenyard.wire.outputs import Completion

USER = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


def msg(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4, "messages": USER, **fields}


def refused(schema: type, body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        parse_body(schema, json.dumps(body))
    assert info.value.status == 400
    return info.value


def documented(params: Any) -> set[str]:
    return set(params.__required_keys__ | params.__optional_keys__)


# ---------------------------------------------------------------------------- the SDKs' lists


@pytest.mark.parametrize(("params", "schema", "refused_names"), [
    (chat_create.CompletionCreateParamsStreaming, ChatCompletionRequest, CHAT_UNSUPPORTED),
    (legacy_create.CompletionCreateParamsStreaming, CompletionRequest, {}),
    (claude_create.MessageCreateParamsStreaming, MessagesRequest, REFUSED),
    (claude_beta_create.MessageCreateParamsStreaming, MessagesRequest, REFUSED),
    (claude_count.MessageCountTokensParams, CountTokensRequest, REFUSED),
    (claude_beta_count.MessageCountTokensParams, CountTokensRequest, REFUSED),
    (responses_create.ResponseCreateParamsStreaming, ResponsesRequest, RESPONSES_UNSUPPORTED),
])
def test_every_field_the_sdks_document_is_known(params: Any, schema: Any,
                                                refused_names: dict[str, Any]) -> None:
    # `betas` travels as the anthropic-beta header, not in the body.
    missing = documented(params) - {"betas"} - set(schema.model_fields) - set(refused_names)
    assert not missing


@pytest.mark.parametrize("name", sorted(documented(
    responses_create.ResponseCreateParamsStreaming)))
def test_no_documented_responses_field_is_an_unrecognized_argument(name: str) -> None:
    # A value no field takes: whatever the verdict, it names the field as a known one.
    body = {"model": "m", "input": "Hi", name: {"?": ["?"]}}
    try:
        parse_body(ResponsesRequest, json.dumps(body))
    except APIError as err:
        assert err.status == 400 and err.param is not None
        assert err.param.split(".")[0] == name
        assert "Unrecognized" not in err.message


# ---------------------------------------------------------------------------- openai


@pytest.mark.parametrize("fields", [
    {"store": True}, {"metadata": {"k": "v"}}, {"service_tier": "flex"}, {"user": "u"},
    {"safety_identifier": "s"}, {"prompt_cache_key": "k"},
    {"prompt_cache_retention": "24h"}, {"prompt_cache_options": {"mode": "implicit"}},
    {"modalities": ["text"]}, {"verbosity": "low"}, {"parallel_tool_calls": False},
    {"prediction": {"type": "content", "content": "Hello"}},
    {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    *({"reasoning_effort": level} for level in
      ("none", "minimal", "low", "medium", "high", "xhigh", "max")),
    {"tool_choice": "auto"}, {"tool_choice": "none", "tools": []},
])
def test_documented_chat_fields_without_effect_are_accepted(fields: dict[str, Any]) -> None:
    req = parse_body(ChatCompletionRequest, json.dumps(chat(**fields)))
    _, params = chat_request_to_engine(req)
    _, plain = chat_request_to_engine(parse_body(ChatCompletionRequest, json.dumps(chat())))
    assert params == plain


@pytest.mark.parametrize(("fields", "param"), [
    ({"web_search_options": {}}, "web_search_options"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
])
def test_documented_chat_fields_this_server_cannot_honour_are_refused(
        fields: dict[str, Any], param: str) -> None:
    err = refused(ChatCompletionRequest, chat(**fields))
    assert err.param == param and err.code == "unsupported_parameter"
    assert param in err.message


@pytest.mark.parametrize(("fields", "param"), [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"verbosity": "loud"}, "verbosity"),
    ({"service_tier": "gold"}, "service_tier"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tool to call
])
def test_bad_values_of_accepted_fields_are_400s_naming_them(fields: dict[str, Any],
                                                             param: str) -> None:
    assert refused(ChatCompletionRequest, chat(**fields)).param == param


def test_unknown_fields_are_400s_naming_them_in_both_openai_routes() -> None:
    for schema, body in ((ChatCompletionRequest, chat(reasoning={"effort": "low"})),
                         (CompletionRequest, {"model": "m", "prompt": "p", "reasoning": 1})):
        err = refused(schema, body)
        assert err.param == "reasoning" and "reasoning" in err.message


def test_chat_bodies_have_the_fields_current_sdks_expect() -> None:
    done = Completion(index=0, text="Hi", token_ids=[1], finish_reason="stop")
    raw = json.loads(build_chat_completion(
        id="chatcmpl-1", model="m", created=1, completions=[done], prompt_tokens=3,
    ).model_dump_json())
    message = raw["choices"][0]["message"]
    assert message["annotations"] == [] and message["refusal"] is None
    assert raw["service_tier"] == "default" and "system_fingerprint" in raw
    assert raw["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "audio_tokens": 0}
    assert raw["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0}
    parsed = ChatCompletion.model_validate(raw)
    assert parsed.choices[0].message.annotations == [] and parsed.service_tier == "default"
    chunk = json.loads(ChatStream("chatcmpl-1", "m", 1).role_chunk().model_dump_json())
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": "",
                                            "refusal": None}
    assert chunk["service_tier"] == "default"


# ---------------------------------------------------------------------------- responses


def resp(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "Hi", **fields}


@pytest.mark.parametrize("fields", [
    {"store": False}, {"metadata": {"k": "v"}}, {"service_tier": "flex"}, {"user": "u"},
    {"safety_identifier": "s"}, {"prompt_cache_key": "k"},
    {"prompt_cache_retention": "24h"},
    {"prompt_cache_options": {"mode": "explicit", "ttl": "1h", "prewarm": False}},
    {"access_programs": {}}, {"access_programs": {"cyber": "standard"}},
    {"image": {"context_compression": "auto"}}, {"image": {"context_compression": "disabled"}},
    {"background": False}, {"background_options": None}, {"context_management": []},
    {"moderation": None}, {"reasoning": {"effort": "none"}},
    {"text": {"verbosity": "low"}}, {"truncation": "disabled"},
    {"stream": True, "stream_options": {"include_obfuscation": False}},
    {"tool_choice": "auto"}, {"tool_choice": "none", "tools": []},
])
def test_documented_responses_fields_without_effect_are_accepted(fields: dict[str, Any]) -> None:
    req = parse_body(ResponsesRequest, json.dumps(resp(**fields)))
    plain = parse_body(ResponsesRequest, json.dumps(resp()))
    assert request_params(req) == request_params(plain)
    assert tool_use(req) is None and text_grammar(req) is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"access_programs": {"cyber": "daybreak_red"}}, "access_programs"),
    ({"background_options": {"completion_window": "2h"}}, "background_options"),
    ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]},
     "context_management"),
    ({"image": {"context_compression": "enabled"}}, "image"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"prompt_cache_options": {"prewarm": True}}, "prompt_cache_options"),
])
def test_documented_responses_fields_this_server_cannot_honour_are_refused(
        fields: dict[str, Any], param: str) -> None:
    err = refused(ResponsesRequest, resp(**fields))
    assert err.param == param and err.code == "unsupported_parameter"
    assert f"'{param}'" in err.message


# ---------------------------------------------------------------------------- anthropic


@pytest.mark.parametrize("fields", [
    {"metadata": {"user_id": "u"}}, {"service_tier": "standard_only"}, {"speed": "fast"},
    {"inference_geo": "us"}, {"diagnostics": {"previous_message_id": "msg_1"}},
    {"user_profile_id": "p"}, {"workspace_id": "w"}, {"top_k": 5},
    {"stop_sequences": ["\n\n"]}, {"thinking": {"type": "disabled"}},
    {"thinking": {"type": "adaptive"}}, {"output_config": {"effort": "low"}},
    {"tool_choice": {"type": "auto"}}, {"tool_choice": {"type": "none"}, "tools": []},
    {"container": None}, {"mcp_servers": []},
])
def test_documented_messages_fields_are_accepted(fields: dict[str, Any]) -> None:
    req = parse_body(MessagesRequest, json.dumps(msg(**fields)))
    _, params = anthropic_request_to_engine(req)
    assert params.guided is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"container": "container_1"}, "container"),
    ({"mcp_servers": [{"type": "url", "url": "ftp://x", "name": "x"}]}, "mcp_servers.0.url"),
    ({"context_management": {"edits": []}}, "context_management"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"output_config": {"effort": "most"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_format": {"type": "json_schema", "schema": SCHEMA},
      "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
     "output_format"),
    ({"top_kk": 2}, "top_kk"),
])
def test_messages_fields_this_server_cannot_honour_are_400s_naming_them(
        fields: dict[str, Any], param: str) -> None:
    err = refused(MessagesRequest, msg(**fields))
    assert err.param == param
    status, raw, _ = render_anthropic(err, request_id="req_1")
    body = json.loads(raw)
    assert status == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert param.split(".")[0] in body["error"]["message"]


@pytest.mark.parametrize(("fields", "field"), [
    ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA},
                        "effort": "high"}}, "output_config.format.schema"),
    ({"output_format": {"type": "json_schema", "schema": SCHEMA}}, "output_format.schema"),
])
def test_output_format_becomes_the_json_schema_grammar(fields: dict[str, Any],
                                                       field: str) -> None:
    _, params = anthropic_request_to_engine(parse_body(MessagesRequest,
                                                       json.dumps(msg(**fields))))
    assert params.guided is not None
    assert (params.guided.kind, json.loads(params.guided.spec), params.guided.param) == (
        "json_schema", SCHEMA, field)
    count = parse_body(CountTokensRequest, json.dumps(
        {"model": "m", "messages": USER, **fields}))
    assert count.output_schema == (field, SCHEMA)


def test_messages_bodies_have_the_fields_current_sdks_expect() -> None:
    done = Completion(index=0, text="Hi", token_ids=[1], finish_reason="stop")
    raw = json.loads(build_anthropic_message(id="msg_1", model="m", completion=done,
                                             prompt_tokens=3).model_dump_json())
    assert raw["container"] is None
    usage = raw["usage"]
    assert usage["cache_creation"] == {"ephemeral_5m_input_tokens": 0,
                                       "ephemeral_1h_input_tokens": 0}
    assert usage["server_tool_use"] is None and usage["service_tier"] == "standard"
    parsed = Message.model_validate(raw)
    assert parsed.usage.service_tier == "standard" and parsed.container is None
