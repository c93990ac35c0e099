"""What current client libraries send and expect, through the official SDKs against
`tokenyard serve`: Anthropic structured output (`messages.parse`, streamed and not, and
the beta's earlier `output_format` spelling), `tool_choice` without tools, documented
fields without effect accepted, unknown ones refused by name in each API's error shape,
and the response fields the SDKs' models have."""

from __future__ import annotations

import json
from typing import Any, Literal

import anthropic
import openai
import pydantic
import pytest

from tests.e2e.conftest import Server

pytestmark = pytest.mark.slow

ASK: list[Any] = [{"role": "user", "content": "Pick a colour and a small count, as JSON."}]
HI: list[Any] = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0}


class Pick(pydantic.BaseModel):
    colour: Literal["red", "green", "blue"]
    count: int
    sure: bool


@pytest.fixture(scope="module")
def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                         max_retries=0)


# ---------------------------------------------------------------------------- structured output


def test_messages_parse_returns_the_pydantic_object(claude: anthropic.Anthropic,
                                                    server: Server) -> None:
    m = claude.messages.parse(model=server.model, max_tokens=60, messages=ASK,
                              output_format=Pick, extra_body=GREEDY)
    assert m.stop_reason == "end_turn"
    assert isinstance(m.parsed_output, Pick)
    assert m.content[0].type == "text"
    assert Pick.model_validate_json(m.content[0].text) == m.parsed_output


def test_streamed_output_format_parses_too(claude: anthropic.Anthropic, server: Server) -> None:
    with claude.messages.stream(model=server.model, max_tokens=60, messages=ASK,
                                output_format=Pick, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert isinstance(final.parsed_output, Pick)


def test_the_beta_client_parses_too(claude: anthropic.Anthropic, server: Server) -> None:
    m = claude.beta.messages.parse(model=server.model, max_tokens=60, messages=ASK,
                                   output_format=Pick, extra_body=GREEDY)
    assert isinstance(m.parsed_output, Pick)


def test_the_beta_output_format_spelling_is_the_same_grammar(claude: anthropic.Anthropic,
                                                             server: Server) -> None:
    schema = {"type": "object", "properties": {"sure": {"type": "boolean"}},
              "required": ["sure"], "additionalProperties": False}
    m = claude.messages.create(
        model=server.model, max_tokens=20, messages=ASK,
        extra_body={**GREEDY, "output_format": {"type": "json_schema", "schema": schema}})
    assert m.content[0].type == "text"
    assert isinstance(json.loads(m.content[0].text)["sure"], bool)


def test_an_output_schema_the_grammar_cannot_enforce_is_a_400_naming_it(
        claude: anthropic.Anthropic, server: Server) -> None:
    bad = {"type": "object", "not": {"required": ["x"]}}
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=server.model, max_tokens=4, messages=ASK,
                               output_config={"format": {"type": "json_schema", "schema": bad}})
    assert "output_config.format.schema" in info.value.message


# ---------------------------------------------------------------------------- tool_choice


def test_tool_choice_without_tools_is_accepted_in_both_dialects(
        claude: anthropic.Anthropic, client: openai.OpenAI, server: Server) -> None:
    for claude_choice, tools in (({"type": "auto"}, None), ({"type": "none"}, [])):
        m = claude.messages.create(model=server.model, max_tokens=2, messages=HI,
                                   tool_choice=claude_choice,  # type: ignore[arg-type]
                                   **({} if tools is None else {"tools": tools}))
        assert [b.type for b in m.content] == ["text"]
    r = client.chat.completions.create(model=server.model, max_tokens=2, messages=HI,
                                       tools=[], tool_choice="auto")
    assert r.choices[0].message.tool_calls is None


# ---------------------------------------------------------------------------- fields


def test_documented_fields_without_effect_are_accepted(claude: anthropic.Anthropic,
                                                       client: openai.OpenAI,
                                                       server: Server) -> None:
    r = client.chat.completions.create(
        model=server.model, max_tokens=2, messages=HI, store=False, metadata={"k": "v"},
        service_tier="auto", user="u-1", safety_identifier="s-1", prompt_cache_key="k",
        prompt_cache_retention="in_memory", modalities=["text"], reasoning_effort="low",
        verbosity="low", prediction={"type": "content", "content": "Hello"},
        parallel_tool_calls=True)
    assert r.choices[0].message.content is not None
    m = claude.messages.create(
        model=server.model, max_tokens=2, messages=HI, metadata={"user_id": "u-1"},
        service_tier="standard_only", speed="standard", inference_geo="us",
        thinking={"type": "disabled"}, stop_sequences=["\n\n"],
        output_config={"effort": "low"}, extra_body={"top_k": 5})
    assert m.content[0].type == "text"


def test_unknown_fields_are_400s_naming_them_in_each_dialect(claude: anthropic.Anthropic,
                                                             client: openai.OpenAI,
                                                             server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=server.model, max_tokens=2, messages=HI,
                                       extra_body={"frobnicate": 1})
    assert chat.value.param == "frobnicate" and "frobnicate" in chat.value.message
    with pytest.raises(openai.BadRequestError) as legacy:
        client.completions.create(model=server.model, max_tokens=2, prompt="Hi",
                                  extra_body={"frobnicate": 1})
    assert legacy.value.param == "frobnicate"
    with pytest.raises(anthropic.BadRequestError) as messages:
        claude.messages.create(model=server.model, max_tokens=2, messages=HI,
                               extra_body={"frobnicate": 1})
    body: Any = messages.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "frobnicate" in body["error"]["message"]


def test_fields_this_server_cannot_honour_are_refused_by_name(claude: anthropic.Anthropic,
                                                              client: openai.OpenAI,
                                                              server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as search:
        client.chat.completions.create(model=server.model, max_tokens=2, messages=HI,
                                       web_search_options={})
    assert search.value.param == "web_search_options"
    with pytest.raises(anthropic.BadRequestError) as container:
        claude.messages.create(model=server.model, max_tokens=2, messages=HI,
                               container="container_1")
    assert "container" in container.value.message


# ---------------------------------------------------------------------------- response fields


def test_chat_responses_have_the_fields_current_sdks_read(client: openai.OpenAI,
                                                          server: Server) -> None:
    r = client.chat.completions.create(model=server.model, max_tokens=2, messages=HI)
    message = r.choices[0].message
    assert message.annotations == [] and message.refusal is None
    assert r.service_tier == "default" and r.system_fingerprint
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    chunks = list(client.chat.completions.create(model=server.model, max_tokens=2,
                                                 messages=HI, stream=True))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.refusal is None
    assert "refusal" in (first.model_extra or {}) or "refusal" in first.model_fields_set


def test_messages_responses_have_the_fields_current_sdks_read(claude: anthropic.Anthropic,
                                                              server: Server) -> None:
    m = claude.messages.create(model=server.model, max_tokens=2, messages=HI)
    assert m.container is None and m.usage.server_tool_use is None
    assert m.usage.service_tier == "standard"
    assert m.usage.cache_creation is not None
    assert m.usage.cache_creation.ephemeral_5m_input_tokens == 0
