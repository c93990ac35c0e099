"""External OpenAI-compatible upstreams served through tokenyard's own routes.

A fleet file names two upstream deployments: a real `tokenyard serve` (OpenAI mode) and
the project's mock OpenAI server, whose failures are injected through its config route.
Both are called through the official `openai` and `anthropic` SDKs on tokenyard's OpenAI
and Anthropic routes: text and usage come through, the response names the deployment,
and the upstream's refusals and failures become tokenyard's own errors.
"""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

from tests.e2e.conftest import Server
from tests.integration.upstreams import MOCK, REAL
from tests.integration.upstreams import configure_mock as _configure

pytestmark = pytest.mark.slow



def _openai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key or "x",
                         max_retries=0)


def _anthropic(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key or "x",
                               max_retries=0)


def test_a_real_tokenyard_upstream_through_the_openai_route(
        upstream_fleet: tuple[Server, str]) -> None:
    server, _ = upstream_fleet
    client = _openai(server)
    reply = client.chat.completions.create(
        model="up", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8,
        temperature=0)
    assert reply.model == REAL  # the alias resolved; the deployment is named
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.prompt_tokens > 5
    assert reply.usage.completion_tokens == 8 or reply.choices[0].finish_reason == "stop"
    text = ""
    with client.chat.completions.create(
            model=REAL, messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}) as stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
    assert text == reply.choices[0].message.content  # greedy: the same answer streamed
    listed = {m.id for m in client.models.list()}
    assert {REAL, MOCK, "up"} <= listed


def test_a_real_tokenyard_upstream_through_the_anthropic_route(
        upstream_fleet: tuple[Server, str]) -> None:
    server, _ = upstream_fleet
    client = _anthropic(server)
    message = client.messages.create(
        model="up", max_tokens=8, messages=[{"role": "user", "content": "Name a colour."}])
    assert message.model == REAL
    assert message.content[0].type == "text" and message.content[0].text
    # The upstream's prefix cache answers part of the prompt: it is reported as a read.
    prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert prompt > 5 and message.usage.output_tokens > 0
    with client.messages.stream(
            model="up", max_tokens=8,
            messages=[{"role": "user", "content": "Name a colour."}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed and final.usage.output_tokens > 0


def test_structured_output_is_enforced_by_the_upstream_in_both_dialects(
        upstream_fleet: tuple[Server, str]) -> None:
    """The grammar goes on to the upstream (`response_format`, `guided_regex`): its
    answer follows it, never silently free text."""
    server, _ = upstream_fleet
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}
    reply = _openai(server).chat.completions.create(
        model="up", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=24,
        temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "c", "schema": schema, "strict": True}})
    assert set(json.loads(reply.choices[0].message.content or "")) == {"colour"}
    digits = _openai(server).chat.completions.create(
        model="up", messages=[{"role": "user", "content": "Pick a number."}], max_tokens=8,
        temperature=0, extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].message.content or ""), digits
    message = _anthropic(server).messages.create(
        model="up", max_tokens=24, messages=[{"role": "user", "content": "Name a colour."}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert message.content[0].type == "text"
    assert set(json.loads(message.content[0].text)) == {"colour"}


def test_the_upstreams_refusals_become_ours(upstream_fleet: tuple[Server, str]) -> None:
    server, mock = upstream_fleet
    body = {"model": MOCK, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    try:
        _configure(mock, inject_429=1.0)
        with pytest.raises(openai.APIStatusError) as caught:
            _openai(server).chat.completions.create(**body)  # type: ignore[call-overload]
        assert caught.value.status_code == 503
        assert float(caught.value.response.headers["retry-after"]) > 0
        with pytest.raises(anthropic.APIStatusError) as refused:
            _anthropic(server).messages.create(**body)  # type: ignore[call-overload]
        assert refused.value.status_code == 529
        assert refused.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]

        _configure(mock, inject_500=1.0)
        with pytest.raises(openai.APIStatusError) as failed:
            _openai(server).chat.completions.create(**body)  # type: ignore[call-overload]
        assert failed.value.status_code == 503  # unavailable: retry, not a 500

        _configure(mock, inject_stream_error=1.0)
        with pytest.raises(openai.APIError):
            for _ in _openai(server).chat.completions.create(  # type: ignore[call-overload]
                    **body, stream=True):
                pass
    finally:
        _configure(mock)
    reply = _openai(server).chat.completions.create(**body)  # type: ignore[call-overload]
    assert reply.model == MOCK and reply.choices[0].message.content
