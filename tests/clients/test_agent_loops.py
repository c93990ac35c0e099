"""The final answer after a tool result (issue 41): a real SDK agent loop per API, run
TRIES times at once at temperature 1 against the session's server, each ending in text.

- /v1/chat/completions: openai-agents on its Chat Completions model (tool_choice
  required for the first step; the SDK resets it to auto after the call).
- /v1/responses: pydantic-ai's OpenAIResponsesModel (required at the first step, then
  auto: the tools stay offered).
- /v1/messages: the anthropic SDK's tool runner (`beta.messages.tool_runner`), its
  tool_choice set from `any` to `auto` once the call came back.

Every run must call the tool, send its result back, and end with non-empty text; the
request that got the final answer carried the tool's result (what "uses the result"
means for a 135M model at temperature 1: it answered from it, not that it is right).
No text of any reply may hold tool markup. The model may call again after a result
(auto); the loops allow a few turns for that.
"""

from __future__ import annotations

import asyncio
import json
import os
import typing
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anthropic
import openai
import pytest

from tests.clients.conftest import (
    ASK_WEATHER,
    WEATHER_RESULT,
    Target,
    check_text,
    client_library,
    get_weather,
)
from tokenyard.text.tools import MARKUP

agents = client_library("agents")
pydantic_ai = client_library("pydantic_ai")

from pydantic_ai.capabilities import AbstractCapability  # noqa: E402
from pydantic_ai.messages import ModelResponse, TextPart, ToolReturnPart  # noqa: E402
from pydantic_ai.models.openai import OpenAIResponsesModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402

pytestmark = pytest.mark.slow

#: `make chaos` (TOKENYARD_CHAOS=full) runs the issue's 20 tries per API, every one of
#: which must end in text; `make test` runs a short 6 (a few minutes less on 2 cores), of
#: which one may still be calling the tool when its turns run out (a 135M model sampling
#: at temperature 1). An HTTP error or tool markup fails either.
FULL = os.environ.get("TOKENYARD_CHAOS", "").strip().lower() == "full"
TRIES = 20 if FULL else 6
MAY_MISS = 0 if FULL else 1
#: Room for a short answer; a cut one still counts as text (openai-agents' Chat
#: Completions model and pydantic-ai take a length finish as an answer).
MAX_TOKENS = 48
#: A model that calls again after the result gets another round, up to this many turns.
MAX_TURNS = 6


def _recording(sent: list[dict[str, Any]]) -> Callable[[Any], Awaitable[None]]:
    async def record(request: Any) -> None:
        if request.content:
            sent.append(json.loads(request.content))
    return record


def _openai(t: Target, sent: list[dict[str, Any]]) -> openai.AsyncOpenAI:
    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [_recording(sent)]})
    return openai.AsyncOpenAI(base_url=t.openai_url, api_key=t.api_key, max_retries=0,
                              http_client=http)


def _no_markup(texts: list[str], what: str) -> None:
    leaked = [s for s in texts if any(tag in s for tag in MARKUP)]
    assert not leaked, f"{what}: tool markup in content: {leaked!r}"


def _answered_from_result(sent: list[dict[str, Any]], what: str) -> None:
    """The last request (the one the final answer came from) carried the tool's result."""
    assert sent and WEATHER_RESULT in json.dumps(sent[-1]), (
        f"{what}: the final answer's request did not carry the tool result: {sent[-1:]!r}")


def _all(run: Callable[[int], Awaitable[tuple[str, list[str]]]], what: str) -> None:
    """TRIES runs at once; each gives (its final answer, every reply's text)."""
    async def tries() -> list[tuple[str, list[str]] | BaseException]:
        return await asyncio.gather(*(run(i) for i in range(TRIES)), return_exceptions=True)

    results = asyncio.run(tries())
    failed = [r for r in results if isinstance(r, BaseException)]
    answers = [r for r in results if not isinstance(r, BaseException)]
    empty = [a for a, _ in answers if not a.strip()]
    http = [r for r in failed if isinstance(r, openai.APIError | anthropic.APIError)]
    assert not http and len(failed) + len(empty) <= MAY_MISS, (
        f"{what}: {TRIES - len(failed) - len(empty)} of {TRIES} runs ended in text; "
        f"errors {failed[:3]!r}, empty answers {len(empty)}")
    _no_markup([text for _, texts in answers for text in texts], what)


def test_openai_agents_chat_completions_loop_ends_in_text(target: Target) -> None:
    """openai-agents, /v1/chat/completions."""
    tool = agents.function_tool(get_weather)
    agents.set_tracing_disabled(True)

    async def run(_: int) -> tuple[str, list[str]]:
        sent: list[dict[str, Any]] = []
        model = agents.OpenAIChatCompletionsModel(model=target.model,
                                                  openai_client=_openai(target, sent))
        settings = agents.ModelSettings(temperature=1, max_tokens=MAX_TOKENS,
                                        parallel_tool_calls=False, tool_choice="required")
        agent = agents.Agent(name="assistant", model=model, model_settings=settings,
                             tools=[tool])
        result = await agents.Runner.run(agent, ASK_WEATHER, max_turns=MAX_TURNS)
        outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
        assert outputs and WEATHER_RESULT in str(outputs[0].output), result.new_items
        _answered_from_result(sent, "openai-agents")
        texts = [c.text for r in result.raw_responses for item in r.output
                 if item.type == "message" for c in item.content if hasattr(c, "text")]
        check_text(result.final_output, "openai-agents' final answer")
        return str(result.final_output), texts

    _all(run, "openai-agents on /v1/chat/completions")


class _CallThenAuto(AbstractCapability[None]):
    """The first step must call the tool; later ones are free (auto, the tools offered)."""

    def get_model_settings(self) -> Any:
        return lambda ctx: {"tool_choice": "required" if ctx.run_step <= 1 else "auto"}


def test_pydantic_ai_responses_loop_ends_in_text(target: Target) -> None:
    """pydantic-ai, /v1/responses."""
    async def run(_: int) -> tuple[str, list[str]]:
        sent: list[dict[str, Any]] = []
        provider = OpenAIProvider(openai_client=_openai(target, sent))
        agent = pydantic_ai.Agent(
            OpenAIResponsesModel(target.model, provider=provider), tools=[get_weather],
            model_settings={"max_tokens": MAX_TOKENS, "temperature": 1,
                            "parallel_tool_calls": False},
            capabilities=[_CallThenAuto()])
        result = await agent.run(ASK_WEATHER,
                                 usage_limits=pydantic_ai.UsageLimits(request_limit=MAX_TURNS))
        parts = [p for m in result.all_messages() for p in m.parts]
        returns = [p for p in parts if isinstance(p, ToolReturnPart)]
        assert returns and WEATHER_RESULT in str(returns[0].content), parts
        _answered_from_result(sent, "pydantic-ai")
        texts = [p.content for m in result.all_messages() if isinstance(m, ModelResponse)
                 for p in m.parts if isinstance(p, TextPart)]
        check_text(result.output, "pydantic-ai's final answer")
        return str(result.output), texts

    _all(run, "pydantic-ai on /v1/responses")


async def _get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city."""
    return get_weather(city, unit)


_get_weather.__annotations__ = typing.get_type_hints(_get_weather)


def test_anthropic_tool_runner_loop_ends_in_text(target: Target) -> None:
    """The anthropic SDK's tool runner, /v1/messages."""
    tool = anthropic.beta_async_tool(_get_weather, name="get_weather")

    async def run(_: int) -> tuple[str, list[str]]:
        sent: list[dict[str, Any]] = []
        http = anthropic.DefaultAsyncHttpxClient(event_hooks={"request": [_recording(sent)]})
        client = anthropic.AsyncAnthropic(base_url=target.anthropic_url,
                                          api_key=target.api_key, max_retries=0,
                                          http_client=http)
        runner = client.beta.messages.tool_runner(
            model=target.model, max_tokens=MAX_TOKENS, max_iterations=MAX_TURNS,
            tools=[tool], tool_choice={"type": "any", "disable_parallel_tool_use": True},
            messages=[{"role": "user", "content": ASK_WEATHER}],
            thread=False, extra_body={"temperature": 1})
        replies = []
        async for message in runner:
            replies.append(message)
            if any(b.type == "tool_use" for b in message.content):
                runner.set_messages_params(lambda p: {
                    **p, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}})
        final = replies[-1]
        assert any(b.type == "tool_use" for b in replies[0].content), replies
        assert final.stop_reason != "tool_use", f"still calling after {MAX_TURNS}: {replies!r}"
        _answered_from_result(sent, "anthropic tool runner")
        texts = [b.text for m in replies for b in m.content if b.type == "text"]
        answer = "".join(b.text for b in final.content if b.type == "text")
        check_text(answer, "the tool runner's final answer")
        return answer, texts

    _all(run, "the anthropic tool runner on /v1/messages")
