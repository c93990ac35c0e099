"""`litellm` (the SDK, not its proxy): the `openai/` provider against the OpenAI dialect,
the `anthropic/` provider against the Anthropic dialect, each with `api_base` set to the
server. LITELLM_LOCAL_MODEL_COST_MAP (tests/clients/conftest.py) keeps its import from
fetching a price list.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

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
    client_library,
)

litellm = client_library("litellm")

pytestmark = pytest.mark.slow

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": WEATHER_DESCRIPTION, "parameters": WEATHER_SCHEMA}}


def _openai(t: Target) -> dict[str, Any]:
    """The arguments that send a litellm call to the OpenAI dialect."""
    return {"model": "openai/" + t.model, "api_base": t.openai_url, "api_key": t.api_key,
            "temperature": 0, "num_retries": 0}


def _anthropic(t: Target) -> dict[str, Any]:
    """The arguments that send a litellm call to the Anthropic dialect."""
    return {"model": "anthropic/" + t.model, "api_base": t.anthropic_url,
            "api_key": t.api_key, "temperature": 0, "num_retries": 0}


Dialect = Callable[[Target], dict[str, Any]]


def _hello() -> list[dict[str, str]]:
    return [{"role": "user", "content": HELLO}]


def _chat(t: Target, dialect: Dialect) -> None:
    r = litellm.completion(messages=_hello(), max_tokens=MAX_TOKENS, **dialect(t))
    what = f"{dialect(t)['model']} completion"
    check_text(r.choices[0].message.content, what)
    details = r.usage.prompt_tokens_details
    check_usage(r.usage.prompt_tokens, r.usage.completion_tokens,
                details.cached_tokens if details else None, f"{what} usage")


def _stream(t: Target, dialect: Dialect) -> None:
    chunks = list(litellm.completion(messages=_hello(), max_tokens=MAX_TOKENS, stream=True,
                                     **dialect(t)))
    check_text("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
               f"{dialect(t)['model']} streamed completion ({len(chunks)} chunks)")


def _tools(t: Target, dialect: Dialect) -> None:
    """litellm takes OpenAI's tool format for every provider and translates it."""
    what = f"{dialect(t)['model']} tool loop"
    messages: list[Any] = [{"role": "user", "content": ASK_WEATHER}]
    first = litellm.completion(messages=messages, tools=[WEATHER_TOOL],
                               tool_choice="required", parallel_tool_calls=False,
                               max_tokens=MAX_STRUCTURED, **dialect(t))
    calls = first.choices[0].message.tool_calls or []
    assert calls and calls[0].function.name == "get_weather", (
        f"{what}: tool_choice required gave no get_weather call: {first.choices[0]!r}")
    check_weather_args(json.loads(calls[0].function.arguments), what)
    messages += [first.choices[0].message,
                 {"role": "tool", "tool_call_id": calls[0].id, "content": WEATHER_RESULT}]
    second = litellm.completion(messages=messages, tools=[WEATHER_TOOL], tool_choice="none",
                                max_tokens=MAX_TOKENS, **dialect(t))
    check_text(second.choices[0].message.content, f"{what}: the answer after the result")


def usage(t: Target) -> None:
    chunks = list(litellm.completion(messages=_hello(), max_tokens=MAX_TOKENS, stream=True,
                                     stream_options={"include_usage": True}, **_openai(t)))
    u = litellm.stream_chunk_builder(chunks).usage
    details = u.prompt_tokens_details
    check_usage(u.prompt_tokens, u.completion_tokens,
                details.cached_tokens if details else None, "streamed usage")


def structured(t: Target) -> None:
    r = litellm.completion(messages=[{"role": "user", "content": ASK_CITY}],
                           response_format=City, max_tokens=MAX_STRUCTURED, **_openai(t))
    content = r.choices[0].message.content
    check_city(City.model_validate_json(content), f"response_format=City content {content!r}")


def embeddings(t: Target) -> None:
    r = litellm.embedding(model="openai/" + EMBEDDING_MODEL, input=["one", "two"],
                          api_base=t.openai_url, api_key=t.api_key)
    check_embeddings([d["embedding"] for d in r.data], 2, "embedding")


def responses(t: Target) -> None:
    args = _openai(t)
    del args["num_retries"]
    r = litellm.responses(input=HELLO, max_output_tokens=MAX_TOKENS, **args)
    text = "".join(c.text for item in r.output if item.type == "message"
                   for c in item.content if c.type == "output_text")
    check_text(text, "responses")
    check_usage(r.usage.input_tokens, r.usage.output_tokens,
                r.usage.input_tokens_details.cached_tokens, "responses usage")


LITELLM_CELLS: dict[str, Cell] = {
    "chat": lambda t: _chat(t, _openai), "stream": lambda t: _stream(t, _openai),
    "usage": usage, "structured": structured, "tools": lambda t: _tools(t, _openai),
    "embeddings": embeddings, "responses": responses,
    "anthropic-chat": lambda t: _chat(t, _anthropic),
    "anthropic-stream": lambda t: _stream(t, _anthropic),
    "anthropic-tools": lambda t: _tools(t, _anthropic),
}


def test_litellm(cell: Cell, target: Target) -> None:
    cell(target)
