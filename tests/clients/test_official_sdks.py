"""The official `openai` and `anthropic` SDKs: the reference every other client builds on.

tests/e2e covers these SDKs in depth; here each does the matrix's cells once, so that a
regression shows up in the same table as the clients built on them.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.clients.conftest import (
    ASK_CITY,
    ASK_WEATHER,
    EMBEDDING_MODEL,
    HELLO,
    MAX_STRUCTURED,
    MAX_TOKENS,
    WEATHER_DESCRIPTION,
    WEATHER_RESULT,
    WEATHER_SCHEMA,
    Cell,
    City,
    Target,
    check_city,
    check_embeddings,
    check_text,
    check_usage,
    check_weather_args,
)

pytestmark = pytest.mark.slow

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": WEATHER_DESCRIPTION, "parameters": WEATHER_SCHEMA}}
#: The anthropic SDK (2.x) dropped its `temperature` argument; the API still takes it.
COLD = {"temperature": 0}
CLAUDE_WEATHER = {"name": "get_weather", "description": WEATHER_DESCRIPTION,
                  "input_schema": WEATHER_SCHEMA}


def _openai(t: Target) -> openai.OpenAI:
    return openai.OpenAI(base_url=t.openai_url, api_key=t.api_key, max_retries=0)


def _claude(t: Target) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=t.anthropic_url, api_key=t.api_key, max_retries=0)


def openai_chat(t: Target) -> None:
    r = _openai(t).chat.completions.create(
        model=t.model, messages=[{"role": "user", "content": HELLO}],
        max_tokens=MAX_TOKENS, temperature=0)
    check_text(r.choices[0].message.content, "chat.completions.create")


def openai_stream(t: Target) -> None:
    chunks = list(_openai(t).chat.completions.create(
        model=t.model, messages=[{"role": "user", "content": HELLO}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True))
    check_text("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
               f"streamed chat ({len(chunks)} chunks)")


def openai_usage(t: Target) -> None:
    chunks = list(_openai(t).chat.completions.create(
        model=t.model, messages=[{"role": "user", "content": HELLO}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None, "the stream's last chunk has no usage (include_usage was set)"
    details = usage.prompt_tokens_details
    check_usage(usage.prompt_tokens, usage.completion_tokens,
                details.cached_tokens if details else None, "streamed usage")


def openai_structured(t: Target) -> None:
    r = _openai(t).chat.completions.parse(
        model=t.model, messages=[{"role": "user", "content": ASK_CITY}],
        response_format=City, max_tokens=MAX_STRUCTURED, temperature=0)
    check_city(r.choices[0].message.parsed, "chat.completions.parse(response_format=City)")


def openai_tools(t: Target) -> None:
    client = _openai(t)
    messages: list[dict[str, object]] = [{"role": "user", "content": ASK_WEATHER}]
    first = client.chat.completions.create(
        model=t.model, messages=messages, tools=[WEATHER_TOOL],
        tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_STRUCTURED,
        temperature=0)
    calls = first.choices[0].message.tool_calls or []
    assert first.choices[0].finish_reason == "tool_calls" and len(calls) >= 1, (
        f"a required tool_choice gave no call: {first.choices[0]!r}")
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather", call
    check_weather_args(json.loads(call.function.arguments), "tool call")
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT}]
    second = client.chat.completions.create(
        model=t.model, messages=messages, tools=[WEATHER_TOOL],
        tool_choice="none", max_tokens=MAX_TOKENS, temperature=0)
    check_text(second.choices[0].message.content, "the answer after the tool result")


def openai_embeddings(t: Target) -> None:
    r = _openai(t).embeddings.create(model=EMBEDDING_MODEL, input=["one", "two"])
    check_embeddings([d.embedding for d in r.data], 2, "embeddings.create")


def openai_responses(t: Target) -> None:
    r = _openai(t).responses.create(model=t.model, input=HELLO, max_output_tokens=MAX_TOKENS,
                                    temperature=0)
    check_text(r.output_text, "responses.create")
    assert r.usage is not None, "responses.create: no usage"
    check_usage(r.usage.input_tokens, r.usage.output_tokens,
                r.usage.input_tokens_details.cached_tokens, "responses.create usage")


def openai_responses_stream(t: Target) -> None:
    # The last lifecycle event carries the response: response.completed, or
    # response.incomplete when max_output_tokens ends it (the SDK's get_final_response
    # knows only the first).
    deltas, final = [], None
    with _openai(t).responses.stream(model=t.model, input=HELLO,
                                     max_output_tokens=MAX_TOKENS, temperature=0) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
    check_text("".join(deltas), "responses.stream deltas")
    assert final is not None, "responses.stream: no response.completed or .incomplete event"
    assert final.output_text == "".join(deltas), (
        f"the final response's text {final.output_text!r} is not its deltas {deltas!r}")


OPENAI_CELLS: dict[str, Cell] = {
    "chat": openai_chat, "stream": openai_stream, "usage": openai_usage,
    "structured": openai_structured, "tools": openai_tools, "embeddings": openai_embeddings,
    "responses": openai_responses, "responses-stream": openai_responses_stream,
}


def test_openai(cell: Cell, target: Target) -> None:
    cell(target)


def claude_chat(t: Target) -> None:
    r = _claude(t).messages.create(model=t.model, max_tokens=MAX_TOKENS, extra_body=COLD,
                                   messages=[{"role": "user", "content": HELLO}])
    check_text("".join(b.text for b in r.content if b.type == "text"), "messages.create")


def claude_stream(t: Target) -> None:
    with _claude(t).messages.stream(model=t.model, max_tokens=MAX_TOKENS, extra_body=COLD,
                                    messages=[{"role": "user", "content": HELLO}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    check_text(text, "messages.stream")
    check_usage(final.usage.input_tokens, final.usage.output_tokens,
                final.usage.cache_read_input_tokens, "streamed message usage")


def claude_usage(t: Target) -> None:
    r = _claude(t).messages.create(model=t.model, max_tokens=MAX_TOKENS, extra_body=COLD,
                                   messages=[{"role": "user", "content": HELLO}])
    check_usage(r.usage.input_tokens, r.usage.output_tokens, r.usage.cache_read_input_tokens,
                "message usage")


def claude_structured(t: Target) -> None:
    r = _claude(t).messages.parse(model=t.model, max_tokens=MAX_STRUCTURED, extra_body=COLD,
                                  messages=[{"role": "user", "content": ASK_CITY}],
                                  output_format=City)
    check_city(r.parsed_output, "messages.parse(output_format=City)")


def claude_tools(t: Target) -> None:
    client = _claude(t)
    messages: list[dict[str, object]] = [{"role": "user", "content": ASK_WEATHER}]
    first = client.messages.create(
        model=t.model, max_tokens=MAX_STRUCTURED, extra_body=COLD, messages=messages,
        tools=[CLAUDE_WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses, f"tool_choice any gave no call: {first!r}"
    assert uses[0].name == "get_weather", uses[0]
    check_weather_args(uses[0].input, "tool_use input")
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                               "content": WEATHER_RESULT}]}]
    second = client.messages.create(
        model=t.model, max_tokens=MAX_TOKENS, extra_body=COLD, messages=messages,
        tools=[CLAUDE_WEATHER], tool_choice={"type": "none"})
    check_text("".join(b.text for b in second.content if b.type == "text"),
               "the answer after the tool result")


ANTHROPIC_CELLS: dict[str, Cell] = {
    "chat": claude_chat, "stream": claude_stream, "usage": claude_usage,
    "structured": claude_structured, "tools": claude_tools,
}


def test_anthropic(cell: Cell, target: Target) -> None:
    cell(target)
