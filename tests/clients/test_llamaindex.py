"""LlamaIndex's `OpenAILike` (llama-index-llms-openai-like): the LLM class for
OpenAI-compatible servers, declared a chat model that can call functions.

Embeddings would need another package (llama-index-embeddings-openai-like), not in the
matrix's set: that cell is left out.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.clients.conftest import (
    ASK_CITY,
    ASK_WEATHER,
    HELLO,
    MAX_STRUCTURED,
    MAX_TOKENS,
    WEATHER_RESULT,
    Cell,
    City,
    Target,
    check_city,
    check_text,
    check_usage,
    check_weather_args,
    client_library,
    get_weather,
)

openai_like = client_library("llama_index.llms.openai_like")
llms = client_library("llama_index.core.llms")
prompts = client_library("llama_index.core.prompts")
core_tools = client_library("llama_index.core.tools")

pytestmark = pytest.mark.slow


def _llm(t: Target, max_tokens: int = MAX_TOKENS) -> Any:
    return openai_like.OpenAILike(
        model=t.model, api_base=t.openai_url, api_key=t.api_key, temperature=0,
        max_tokens=max_tokens, max_retries=0, is_chat_model=True,
        is_function_calling_model=True, context_window=8192)


def _hello() -> list[Any]:
    return [llms.ChatMessage(role="user", content=HELLO)]


def chat(t: Target) -> None:
    check_text(_llm(t).chat(_hello()).message.content, "OpenAILike.chat")


def stream(t: Target) -> None:
    chunks = list(_llm(t).stream_chat(_hello()))
    check_text("".join(c.delta or "" for c in chunks),
               f"OpenAILike.stream_chat ({len(chunks)} chunks)")
    assert chunks[-1].message.content == "".join(c.delta or "" for c in chunks), (
        "the last chunk's accumulated message is not the sum of the deltas")


def usage(t: Target) -> None:
    # LlamaIndex keeps the SDK's completion as `raw`; it has no usage type of its own.
    raw = _llm(t).chat(_hello()).raw
    u = raw.usage
    check_usage(u.prompt_tokens, u.completion_tokens,
                u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None,
                "OpenAILike.chat's raw usage")


def structured(t: Target) -> None:
    city = _llm(t, MAX_STRUCTURED).structured_predict(
        City, prompts.PromptTemplate("{ask}"), ask=ASK_CITY)
    check_city(city, "OpenAILike.structured_predict(City)")


def tools(t: Target) -> None:
    llm = _llm(t, MAX_STRUCTURED)
    tool = core_tools.FunctionTool.from_defaults(fn=get_weather)
    history = [llms.ChatMessage(role="user", content=ASK_WEATHER)]
    first = llm.chat_with_tools([tool], chat_history=history, tool_required=True,
                                allow_parallel_tool_calls=False)
    calls = llm.get_tool_calls_from_response(first, error_on_no_tool_call=False)
    assert calls and calls[0].tool_name == "get_weather", (
        f"tool_required=True gave no get_weather call: {first.message!r}")
    check_weather_args(calls[0].tool_kwargs, "tool call")
    history += [first.message, llms.ChatMessage(
        role="tool", content=WEATHER_RESULT,
        additional_kwargs={"tool_call_id": calls[0].tool_id, "name": calls[0].tool_name})]
    second = _llm(t).chat(history)
    check_text(second.message.content, "the answer after the tool result")


LLAMAINDEX_CELLS: dict[str, Cell] = {
    "chat": chat, "stream": stream, "usage": usage, "structured": structured, "tools": tools,
}


def test_llamaindex(cell: Cell, target: Target) -> None:
    cell(target)
