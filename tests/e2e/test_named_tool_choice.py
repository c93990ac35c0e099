"""A named tool choice is one call (issue 29, defect 1), through the official SDKs.

Before the fix a named function with the default `parallel_tool_calls` let the grammar
take up to the deployment's cap of calls: the model repeated the same call until
`max_tokens` (`finish_reason: length`), and the call cut there reached `content` as raw
``<tool_call>`` markup, which broke instructor's TOOLS mode. Now a named choice
(OpenAI's ``{"type": "function", ...}``, Anthropic's ``{"type": "tool", ...}``) allows
one call and then only the end of the turn, whatever `parallel_tool_calls` says, and
text cut inside a call never reaches `content`.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from tests.e2e.conftest import Server
from tests.e2e.test_tools import ASK, WEATHER, WEATHER_SCHEMA

pytestmark = pytest.mark.slow

NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
#: Tries at temperature 1 (each a few dozen tokens).
TRIES = 4


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                         max_retries=0)


def test_openai_named_choice_makes_exactly_one_call(client: openai.OpenAI,
                                                    server: Server) -> None:
    """No `parallel_tool_calls` sent (its default is true): still one call, and the
    reply ends there by itself, well within max_tokens."""
    for seed in range(TRIES):
        r = client.chat.completions.create(
            model=server.model, messages=ASK, tools=[WEATHER], tool_choice=NAMED,
            max_tokens=300, temperature=1.0, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert set(json.loads(call.function.arguments)) <= set(WEATHER_SCHEMA["properties"])
        assert not choice.message.content, choice.message.content


def test_openai_named_choice_streams_exactly_one_call(client: openai.OpenAI,
                                                      server: Server) -> None:
    with client.chat.completions.stream(
            model=server.model, messages=ASK, tools=[WEATHER], tool_choice=NAMED,
            parallel_tool_calls=True, max_tokens=300, temperature=1.0, seed=7) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls", final
    assert final.message.tool_calls is not None and len(final.message.tool_calls) == 1
    assert not final.message.content


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_call_cut_by_max_tokens_never_reaches_content(client: openai.OpenAI,
                                                        server: Server, stream: bool) -> None:
    """max_tokens ends the reply inside the call: finish "length", and no markup (nor
    any other text the call was written in) in `content`."""
    kwargs: dict[str, Any] = dict(model=server.model, messages=ASK, tools=[WEATHER],
                                  tool_choice=NAMED, temperature=1.0, seed=3)
    for max_tokens in (3, 12):
        if stream:  # (the SDK's stream helper raises on "length": read the chunks)
            chunks = list(client.chat.completions.create(max_tokens=max_tokens, stream=True,
                                                         **kwargs))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks
                      if c.choices and c.choices[0].finish_reason]
        else:
            choice = client.chat.completions.create(max_tokens=max_tokens, **kwargs).choices[0]
            content, finish = choice.message.content or "", [choice.finish_reason]
        assert finish == ["length"], finish
        assert content == "", content


def test_anthropic_named_tool_is_exactly_one_tool_use(server: Server) -> None:
    claude = anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key,
                                 max_retries=0)
    tool: Any = {"name": "get_weather", "description": "The current weather in a city.",
                 "input_schema": WEATHER_SCHEMA}
    for seed in range(TRIES // 2):
        r = claude.messages.create(
            model=server.model, max_tokens=300, messages=ASK, tools=[tool],
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body={"temperature": 1.0}, metadata={"user_id": f"seed-{seed}"})
        assert r.stop_reason == "tool_use", r
        assert [b.type for b in r.content] == ["tool_use"], r.content
