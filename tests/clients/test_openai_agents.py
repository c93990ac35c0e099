"""The OpenAI Agents SDK (`openai-agents`): `Agent` + `Runner.run` on its default model
settings, which speak the Responses API, through `set_default_openai_client` pointed at
the server; tracing off (its exporter would call OpenAI). The `chat-completions-*` cells
run the same agent on its Chat Completions model.

A two-step tool run: tool_choice "required" makes the first step call the function tool;
the SDK then resets tool_choice (reset_tool_choice, its default), so the next step is free
to answer in text; max_turns bounds a model that calls again. The SDK takes a reply that
max_tokens cut (response.incomplete) for an error, so its text cells ask ASK_SHORT.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from tests.clients.conftest import (
    ASK_CITY,
    ASK_SHORT,
    ASK_WEATHER,
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

agents = client_library("agents")

pytestmark = pytest.mark.slow

WEATHER = agents.function_tool(get_weather)


def _client(t: Target, sent: list[dict[str, Any]] | None = None) -> openai.AsyncOpenAI:
    """A client of the server; with `sent`, each request's JSON body is appended to it."""
    async def record(request: Any) -> None:
        if sent is not None and request.content:
            sent.append(json.loads(request.content))

    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [record]})
    return openai.AsyncOpenAI(base_url=t.openai_url, api_key=t.api_key, max_retries=0,
                              http_client=http)


def _use(t: Target, sent: list[dict[str, Any]] | None = None) -> None:
    """The SDK's process-wide client, pointed at the server; a fresh one for each run's
    event loop (an AsyncOpenAI's connections belong to the loop that opened them)."""
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(_client(t, sent), use_for_tracing=False)


def _agent(t: Target, chat_completions: bool = False, max_tokens: int = MAX_TOKENS,
           sent: list[dict[str, Any]] | None = None, **kwargs: Any) -> Any:
    model: Any = t.model
    if chat_completions:
        model = agents.OpenAIChatCompletionsModel(model=t.model,
                                                  openai_client=_client(t, sent))
    settings = agents.ModelSettings(temperature=0, max_tokens=max_tokens,
                                    parallel_tool_calls=False,
                                    tool_choice=kwargs.pop("tool_choice", None))
    return agents.Agent(name="assistant", model=model, model_settings=settings, **kwargs)


def _run(t: Target, agent: Any, ask: str, max_turns: int = 3,
         sent: list[dict[str, Any]] | None = None) -> Any:
    _use(t, sent)
    return asyncio.run(agents.Runner.run(agent, ask, max_turns=max_turns))


def _tool_run(t: Target, chat_completions: bool, what: str) -> None:
    sent: list[dict[str, Any]] = []
    agent = _agent(t, chat_completions, MAX_STRUCTURED, sent, tools=[WEATHER],
                   tool_choice="required")
    result = _run(t, agent, ASK_WEATHER, sent=sent)
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert calls, f"{what}: tool_choice required made no call: {result.new_items!r}"
    raw = calls[0].raw_item
    assert raw.name == "get_weather", f"{what}: called {raw.name!r}"
    check_weather_args(json.loads(raw.arguments), f"{what} tool call")
    assert outputs and WEATHER_RESULT in str(outputs[0].output), (
        f"{what}: the tool's output is not in the run: {result.new_items!r}")
    # The second step runs with tool_choice back at auto and the tools still in the
    # prompt. The protocol is what is checked here: the second request carried the
    # tool's output, tied to the call's id, and its prompt grew by them; its reply, with
    # no further call, ended the run (the final answer's text: test_agent_loops.py).
    second_body = json.dumps(sent[1]) if len(sent) == 2 else ""
    assert WEATHER_RESULT in second_body and raw.call_id in second_body, (
        f"{what}: the second request did not carry the tool's output: {sent!r}")
    first, second = (r.usage for r in result.raw_responses[:2])
    assert len(result.raw_responses) == 2 and second.input_tokens > first.input_tokens, (
        f"{what}: the tool's output was not sent back in one more request: "
        f"{result.raw_responses!r}")


def chat(t: Target) -> None:
    check_text(_run(t, _agent(t), ASK_SHORT).final_output, "Runner.run (Responses)")


def stream(t: Target) -> None:
    async def run() -> str:
        result = agents.Runner.run_streamed(_agent(t), ASK_SHORT)
        deltas = [e.data.delta async for e in result.stream_events()
                  if e.type == "raw_response_event"
                  and e.data.type == "response.output_text.delta"]
        return "".join(deltas)

    _use(t)
    check_text(asyncio.run(run()), "Runner.run_streamed text deltas (Responses)")


def usage(t: Target) -> None:
    u = _run(t, _agent(t), ASK_SHORT).context_wrapper.usage
    check_usage(u.input_tokens, u.output_tokens, u.input_tokens_details.cached_tokens,
                "the run's usage (Responses)")


def structured(t: Target) -> None:
    result = _run(t, _agent(t, max_tokens=MAX_STRUCTURED, output_type=City), ASK_CITY)
    check_city(result.final_output, "Agent(output_type=City) (Responses)")


def tools(t: Target) -> None:
    _tool_run(t, False, "two-step tool run (Responses)")


def cc_chat(t: Target) -> None:
    check_text(_run(t, _agent(t, True), ASK_SHORT).final_output, "Runner.run (Chat Completions)")


def cc_structured(t: Target) -> None:
    result = _run(t, _agent(t, True, MAX_STRUCTURED, output_type=City), ASK_CITY)
    check_city(result.final_output, "Agent(output_type=City) (Chat Completions)")


def cc_tools(t: Target) -> None:
    _tool_run(t, True, "two-step tool run (Chat Completions)")


OPENAI_AGENTS_CELLS: dict[str, Cell] = {
    "chat": chat, "stream": stream, "usage": usage, "structured": structured, "tools": tools,
    "chat-completions-chat": cc_chat, "chat-completions-structured": cc_structured,
    "chat-completions-tools": cc_tools,
}


def test_openai_agents(cell: Cell, target: Target) -> None:
    cell(target)
