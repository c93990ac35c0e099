"""LangChain's `langchain-openai` (ChatOpenAI, OpenAIEmbeddings) and `langchain-anthropic`
(ChatAnthropic) chat models, each pointed at the server by `base_url`."""

from __future__ import annotations

from typing import Any

import pytest

from tests.clients.conftest import (
    ASK_CITY,
    ASK_WEATHER,
    EMBEDDING_MODEL,
    HELLO,
    MAX_STRUCTURED,
    MAX_TOKENS,
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

langchain_openai = client_library("langchain_openai")
langchain_anthropic = client_library("langchain_anthropic")
messages = client_library("langchain_core.messages")

pytestmark = pytest.mark.slow


def _chat_openai(t: Target, max_tokens: int = MAX_TOKENS, **extra: Any) -> Any:
    return langchain_openai.ChatOpenAI(model=t.model, base_url=t.openai_url, api_key=t.api_key,
                                       temperature=0, max_tokens=max_tokens, max_retries=0,
                                       **extra)


def _chat_anthropic(t: Target, max_tokens: int = MAX_TOKENS) -> Any:
    return langchain_anthropic.ChatAnthropic(model=t.model, base_url=t.anthropic_url,
                                             api_key=t.api_key, temperature=0,
                                             max_tokens=max_tokens, max_retries=0)


def _usage(message: Any, what: str) -> None:
    """LangChain's own usage record on an AIMessage: input/output tokens and the
    cache-read count under input_token_details."""
    u = message.usage_metadata
    assert u is not None, f"{what}: the message has no usage_metadata"
    check_usage(u["input_tokens"], u["output_tokens"],
                u.get("input_token_details", {}).get("cache_read"), what)


def _chunks_text(chunks: list[Any]) -> str:
    return "".join(c.text if isinstance(c.text, str) else c.text() for c in chunks)


def _tool_loop(model: Any, what: str, **bind: Any) -> None:
    """Forced call, the tool's result sent back as a ToolMessage, then a text answer."""
    ask = [messages.HumanMessage(ASK_WEATHER)]
    first = model.bind_tools([get_weather], **bind).invoke(ask)
    assert first.tool_calls and first.tool_calls[0]["name"] == "get_weather", (
        f"{what}: a forced call gave no get_weather call: {first!r}")
    call = first.tool_calls[0]
    check_weather_args(call["args"], f"{what} tool call")
    result = messages.ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])
    second = model.bind(max_tokens=MAX_TOKENS).invoke([*ask, first, result])
    check_text(second.text if isinstance(second.text, str) else second.text(),
               f"{what}: the answer after the tool result")


def _chat(model: Any) -> None:
    check_text(model.invoke(HELLO).content, f"{type(model).__name__}.invoke")


def _stream(model: Any) -> None:
    chunks = list(model.stream(HELLO))
    check_text(_chunks_text(chunks), f"{type(model).__name__}.stream ({len(chunks)} chunks)")


def openai_usage(t: Target) -> None:
    _usage(_chat_openai(t).invoke(HELLO), "ChatOpenAI usage")
    chunks = list(_chat_openai(t, stream_usage=True).stream(HELLO))
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    _usage(total, "ChatOpenAI streamed usage (stream_usage=True)")


def openai_structured(t: Target) -> None:
    city = _chat_openai(t, MAX_STRUCTURED).with_structured_output(City).invoke(ASK_CITY)
    check_city(city, "ChatOpenAI.with_structured_output(City)")


def openai_tools(t: Target) -> None:
    _tool_loop(_chat_openai(t, MAX_STRUCTURED), "ChatOpenAI", tool_choice="required",
               parallel_tool_calls=False)


def openai_embeddings(t: Target) -> None:
    # check_embedding_ctx_length=False: send the texts, not tiktoken ids of another vocabulary
    emb = langchain_openai.OpenAIEmbeddings(model=EMBEDDING_MODEL, base_url=t.openai_url,
                                            api_key=t.api_key, check_embedding_ctx_length=False)
    check_embeddings(emb.embed_documents(["one", "two"]), 2, "OpenAIEmbeddings.embed_documents")


def openai_responses(t: Target) -> None:
    model = _chat_openai(t, use_responses_api=True)
    reply = model.invoke(HELLO)
    check_text(reply.text if isinstance(reply.text, str) else reply.text(),
               "ChatOpenAI(use_responses_api=True).invoke")
    _usage(reply, "ChatOpenAI Responses usage")


LANGCHAIN_OPENAI_CELLS: dict[str, Cell] = {
    "chat": lambda t: _chat(_chat_openai(t)), "stream": lambda t: _stream(_chat_openai(t)),
    "usage": openai_usage,
    "structured": openai_structured, "tools": openai_tools, "embeddings": openai_embeddings,
    "responses": openai_responses,
}


def test_langchain_openai(cell: Cell, target: Target) -> None:
    cell(target)


def anthropic_usage(t: Target) -> None:
    _usage(_chat_anthropic(t).invoke(HELLO), "ChatAnthropic usage")


def anthropic_structured(t: Target) -> None:
    # The default method forces a tool call; json_schema is output_config.format.
    model = _chat_anthropic(t, MAX_STRUCTURED)
    check_city(model.with_structured_output(City).invoke(ASK_CITY),
               "ChatAnthropic.with_structured_output(City) (function calling)")


def anthropic_structured_native(t: Target) -> None:
    model = _chat_anthropic(t, MAX_STRUCTURED)
    check_city(model.with_structured_output(City, method="json_schema").invoke(ASK_CITY),
               "ChatAnthropic.with_structured_output(City, method='json_schema')")


def anthropic_tools(t: Target) -> None:
    _tool_loop(_chat_anthropic(t, MAX_STRUCTURED), "ChatAnthropic", tool_choice="any",
               parallel_tool_calls=False)


LANGCHAIN_ANTHROPIC_CELLS: dict[str, Cell] = {
    "chat": lambda t: _chat(_chat_anthropic(t)),
    "stream": lambda t: _stream(_chat_anthropic(t)), "usage": anthropic_usage,
    "structured": anthropic_structured, "structured-json-schema": anthropic_structured_native,
    "tools": anthropic_tools,
}


def test_langchain_anthropic(cell: Cell, target: Target) -> None:
    cell(target)
