"""`instructor`: pydantic models out of chat completions, wrapping the official SDKs.

Structured output is the whole of instructor, so its cells are its modes: TOOLS (a forced
function call), JSON_SCHEMA (response_format), partial streaming, the Anthropic tool mode
and the Responses API's tool mode. It has no tool loop of its own (a forced call *is* its
structured output) and no embeddings: those cells are left out.
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from tests.clients.conftest import (
    ASK_CITY,
    HELLO,
    MAX_STRUCTURED,
    MAX_TOKENS,
    Cell,
    City,
    Target,
    check_city,
    check_text,
    check_usage,
    client_library,
)

instructor = client_library("instructor")

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": ASK_CITY}]


def _client(t: Target, mode: Any = None) -> Any:
    sdk = openai.OpenAI(base_url=t.openai_url, api_key=t.api_key, max_retries=0)
    return instructor.from_openai(sdk, mode=mode or instructor.Mode.TOOLS)


def chat(t: Target) -> None:
    # response_model=None: instructor hands back the SDK's own completion.
    r = _client(t).create(model=t.model, messages=[{"role": "user", "content": HELLO}],
                          response_model=None, max_tokens=MAX_TOKENS, temperature=0)
    check_text(r.choices[0].message.content, "create(response_model=None)")


#: Mode.TOOLS names its one function in tool_choice but leaves parallel calls on; a 135M
#: model then starts a second call and runs out of tokens. The SDK's own argument goes
#: through instructor's create unchanged.
ONE_CALL = {"parallel_tool_calls": False}


def structured(t: Target) -> None:
    city = _client(t).create(model=t.model, messages=ASK, response_model=City,
                             max_tokens=MAX_STRUCTURED, temperature=0, max_retries=0,
                             **ONE_CALL)
    check_city(city, "create(response_model=City), Mode.TOOLS")


def structured_json_schema(t: Target) -> None:
    city = _client(t, instructor.Mode.JSON_SCHEMA).create(
        model=t.model, messages=ASK, response_model=City, max_tokens=MAX_STRUCTURED,
        temperature=0, max_retries=0)
    check_city(city, "create(response_model=City), Mode.JSON_SCHEMA")


def stream(t: Target) -> None:
    partials = list(_client(t).create_partial(
        model=t.model, messages=ASK, response_model=City, max_tokens=MAX_STRUCTURED,
        temperature=0, max_retries=0, **ONE_CALL))
    assert len(partials) > 1, f"create_partial streamed {len(partials)} partial(s)"
    final = City.model_validate(partials[-1].model_dump())
    check_city(final, "create_partial's last partial")


def usage(t: Target) -> None:
    city, completion = _client(t).create_with_completion(
        model=t.model, messages=ASK, response_model=City, max_tokens=MAX_STRUCTURED,
        temperature=0, max_retries=0, **ONE_CALL)
    check_city(city, "create_with_completion")
    u = completion.usage
    check_usage(u.prompt_tokens, u.completion_tokens,
                u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None,
                "create_with_completion's usage")


def anthropic_structured(t: Target) -> None:
    sdk = anthropic.Anthropic(base_url=t.anthropic_url, api_key=t.api_key, max_retries=0)
    client = instructor.from_anthropic(sdk, mode=instructor.Mode.ANTHROPIC_TOOLS)
    city = client.create(model=t.model, messages=ASK, response_model=City,
                         max_tokens=MAX_STRUCTURED, max_retries=0,
                         # The anthropic SDK (2.x) dropped `temperature`; the API takes it.
                         extra_body={"temperature": 0})
    check_city(city, "from_anthropic(...).create(response_model=City), ANTHROPIC_TOOLS")


def responses_structured(t: Target) -> None:
    city = _client(t, instructor.Mode.RESPONSES_TOOLS).create(
        model=t.model, messages=ASK, response_model=City, max_output_tokens=MAX_STRUCTURED,
        temperature=0, max_retries=0)
    check_city(city, "create(response_model=City), Mode.RESPONSES_TOOLS")


INSTRUCTOR_CELLS: dict[str, Cell] = {
    "chat": chat, "structured": structured, "structured-json-schema": structured_json_schema,
    "stream": stream, "usage": usage, "anthropic-structured": anthropic_structured,
    "responses": responses_structured,
}


def test_instructor(cell: Cell, target: Target) -> None:
    cell(target)
