"""`pydantic-ai` (pydantic-ai-slim[openai,anthropic]): agents on OpenAIChatModel,
OpenAIResponsesModel and AnthropicModel, each given a provider pointed at the server, and
its Embedder on OpenAIEmbeddingModel."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from tests.clients.conftest import (
    ASK_CITY,
    ASK_WEATHER,
    EMBEDDING_MODEL,
    HELLO,
    MAX_STRUCTURED,
    MAX_TOKENS,
    WEATHER_RESULT,
    Cell,
    City,
    Target,
    check_city,
    check_embeddings,
    check_text,
    check_usage,
    check_weather_args,
    client_library,
    get_weather,
)

pydantic_ai = client_library("pydantic_ai")
from pydantic_ai.capabilities import AbstractCapability  # noqa: E402
from pydantic_ai.embeddings import Embedder  # noqa: E402
from pydantic_ai.embeddings.openai import OpenAIEmbeddingModel  # noqa: E402
from pydantic_ai.messages import ToolCallPart, ToolReturnPart  # noqa: E402
from pydantic_ai.models.anthropic import AnthropicModel  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel  # noqa: E402
from pydantic_ai.profiles.anthropic import AnthropicModelProfile  # noqa: E402
from pydantic_ai.providers.anthropic import AnthropicProvider  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402

pytestmark = pytest.mark.slow


#: The default structured output: an output tool the model is made to call. Named short:
#: the default name, final_result, costs SmolLM2 ~12 of the 48 tokens.
CITY_TOOL = pydantic_ai.ToolOutput(City, name="city")


def _settings(max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0, "parallel_tool_calls": False}


def _openai(t: Target) -> OpenAIChatModel:
    return OpenAIChatModel(t.model, provider=OpenAIProvider(base_url=t.openai_url,
                                                            api_key=t.api_key))


def _anthropic(t: Target) -> AnthropicModel:
    return AnthropicModel(t.model, provider=AnthropicProvider(base_url=t.anthropic_url,
                                                              api_key=t.api_key))


@dataclass
class CallThenAnswer(AbstractCapability[None]):
    """The first step must call a tool, the next must answer in text: pydantic-ai's way to
    force a call once (a static 'required' would forbid the final answer)."""

    def get_model_settings(self) -> Any:
        return lambda ctx: {"tool_choice": "required" if ctx.run_step <= 1 else "none"}


def _agent(model: Any, max_tokens: int = MAX_TOKENS, **kwargs: Any) -> Any:
    return pydantic_ai.Agent(model, model_settings=_settings(max_tokens), **kwargs)


def _chat(model: Any, what: str) -> None:
    result = _agent(model).run_sync(HELLO)
    check_text(result.output, what)
    u = result.usage
    check_usage(u.input_tokens, u.output_tokens, u.cache_read_tokens, f"{what} usage")


def _stream(model: Any, what: str) -> None:
    async def run() -> list[str]:
        async with _agent(model).run_stream(HELLO) as result:
            return [d async for d in result.stream_text(delta=True)]

    deltas = asyncio.run(run())
    check_text("".join(deltas), f"{what} ({len(deltas)} deltas)")


def _tool_loop(model: Any, what: str) -> None:
    agent = _agent(model, MAX_STRUCTURED, tools=[get_weather], capabilities=[CallThenAnswer()])
    result = agent.run_sync(ASK_WEATHER)
    parts = [p for m in result.all_messages() for p in m.parts]
    calls = [p for p in parts if isinstance(p, ToolCallPart)]
    returns = [p for p in parts if isinstance(p, ToolReturnPart)]
    assert calls and calls[0].tool_name == "get_weather", (
        f"{what}: the forced step made no get_weather call: {parts!r}")
    check_weather_args(calls[0].args_as_dict(), f"{what} tool call")
    assert returns and WEATHER_RESULT in str(returns[0].content), (
        f"{what}: the tool's result was not sent back: {parts!r}")
    check_text(result.output, f"{what}: the answer after the tool result")


def openai_chat(t: Target) -> None:
    _chat(_openai(t), "OpenAIChatModel agent run (with usage)")


def openai_stream(t: Target) -> None:
    _stream(_openai(t), "OpenAIChatModel run_stream")


def openai_structured(t: Target) -> None:
    city = _agent(_openai(t), MAX_STRUCTURED, output_type=CITY_TOOL).run_sync(ASK_CITY).output
    check_city(city, "Agent(output_type=City), tool output")


def openai_structured_native(t: Target) -> None:
    agent = _agent(_openai(t), MAX_STRUCTURED, output_type=pydantic_ai.NativeOutput(City))
    check_city(agent.run_sync(ASK_CITY).output, "Agent(output_type=NativeOutput(City))")


def openai_tools(t: Target) -> None:
    _tool_loop(_openai(t), "OpenAIChatModel")


def openai_embeddings(t: Target) -> None:
    provider = OpenAIProvider(base_url=t.openai_url, api_key=t.api_key)
    embedder = Embedder(OpenAIEmbeddingModel(EMBEDDING_MODEL, provider=provider))
    result = embedder.embed_documents_sync(["one", "two"])
    check_embeddings([list(v) for v in result.embeddings], 2, "Embedder.embed_documents")


def openai_responses(t: Target) -> None:
    model = OpenAIResponsesModel(t.model, provider=OpenAIProvider(base_url=t.openai_url,
                                                                  api_key=t.api_key))
    _chat(model, "OpenAIResponsesModel agent run")


def openai_responses_tools(t: Target) -> None:
    model = OpenAIResponsesModel(t.model, provider=OpenAIProvider(base_url=t.openai_url,
                                                                  api_key=t.api_key))
    _tool_loop(model, "OpenAIResponsesModel")


PYDANTIC_AI_OPENAI_CELLS: dict[str, Cell] = {
    "chat+usage": openai_chat, "stream": openai_stream, "structured": openai_structured,
    "structured-native": openai_structured_native, "tools": openai_tools,
    "embeddings": openai_embeddings, "responses": openai_responses,
    "responses-tools": openai_responses_tools,
}


def test_pydantic_ai_openai(cell: Cell, target: Target) -> None:
    cell(target)


def anthropic_chat(t: Target) -> None:
    _chat(_anthropic(t), "AnthropicModel agent run (with usage)")


def anthropic_stream(t: Target) -> None:
    _stream(_anthropic(t), "AnthropicModel run_stream")


def anthropic_structured(t: Target) -> None:
    city = _agent(_anthropic(t), MAX_STRUCTURED,
                  output_type=CITY_TOOL).run_sync(ASK_CITY).output
    check_city(city, "AnthropicModel Agent(output_type=City), tool output")


def anthropic_structured_native(t: Target) -> None:
    # pydantic-ai enables native output only for the Claude names it knows; say it for ours.
    model = AnthropicModel(t.model, provider=AnthropicProvider(base_url=t.anthropic_url,
                                                               api_key=t.api_key),
                           profile=AnthropicModelProfile(supports_json_schema_output=True))
    agent = _agent(model, MAX_STRUCTURED, output_type=pydantic_ai.NativeOutput(City))
    check_city(agent.run_sync(ASK_CITY).output,
               "AnthropicModel Agent(output_type=NativeOutput(City))")


def anthropic_tools(t: Target) -> None:
    _tool_loop(_anthropic(t), "AnthropicModel")


PYDANTIC_AI_ANTHROPIC_CELLS: dict[str, Cell] = {
    "chat+usage": anthropic_chat, "stream": anthropic_stream,
    "structured": anthropic_structured, "structured-native": anthropic_structured_native,
    "tools": anthropic_tools,
}


def test_pydantic_ai_anthropic(cell: Cell, target: Target) -> None:
    cell(target)
