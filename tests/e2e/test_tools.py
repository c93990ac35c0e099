"""Tool calling through the official `openai` and `anthropic` SDKs against
`tokenyard serve` (SmolLM2: the tools reach it through the system-prompt fallback, and
the grammar makes every forced call valid)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.conftest import Server, running_server

pytestmark = pytest.mark.slow

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": WEATHER_SCHEMA}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _string(n: int = 24) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


#: ~20 tools of varied shape: enums, bounded integers and numbers, booleans, nested
#: objects, bounded arrays, anyOf, optional properties, no parameters at all.
SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": WEATHER_SCHEMA,
    "no_arguments": {"type": "object", "properties": {}, "additionalProperties": False},
    "set_volume": {"type": "object", "properties": {
        "level": {"type": "integer", "minimum": 0, "maximum": 10}}, "required": ["level"],
        "additionalProperties": False},
    "toggle_light": {"type": "object", "properties": {"on": {"type": "boolean"},
                                                      "room": _string(12)},
                     "required": ["on", "room"], "additionalProperties": False},
    "convert_currency": {"type": "object", "properties": {
        "amount": {"type": "number", "minimum": 0, "maximum": 1000},
        "from": {"type": "string", "enum": ["USD", "EUR", "JPY"]},
        "to": {"type": "string", "enum": ["USD", "EUR", "JPY"]}},
        "required": ["amount", "from", "to"], "additionalProperties": False},
    "search_web": {"type": "object", "properties": {
        "query": _string(), "max_results": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["query"], "additionalProperties": False},
    "add_tags": {"type": "object", "properties": {
        "tags": {"type": "array", "items": _string(8), "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "book_table": {"type": "object", "properties": {
        "restaurant": _string(), "guests": {"type": "integer", "minimum": 1, "maximum": 8},
        "time": {"type": "string", "enum": ["18:00", "19:00", "20:00"]}},
        "required": ["restaurant", "guests", "time"], "additionalProperties": False},
    "create_user": {"type": "object", "properties": {
        "name": _string(16),
        "address": {"type": "object", "properties": {"city": _string(12),
                                                     "zip": _string(6)},
                    "required": ["city"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "send_email": {"type": "object", "properties": {
        "to": _string(20), "subject": _string(20), "urgent": {"type": "boolean"}},
        "required": ["to", "subject"], "additionalProperties": False},
    "rate_movie": {"type": "object", "properties": {
        "title": _string(), "stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]}},
        "required": ["title", "stars"], "additionalProperties": False},
    "set_timer": {"type": "object", "properties": {
        "minutes": {"type": "integer", "minimum": 1, "maximum": 60},
        "label": {"anyOf": [_string(10), {"type": "null"}]}},
        "required": ["minutes", "label"], "additionalProperties": False},
    "plot_points": {"type": "object", "properties": {
        "points": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                   "maximum": 9},
                                             "y": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}},
            "required": ["x", "y"], "additionalProperties": False}}},
        "required": ["points"], "additionalProperties": False},
    "translate": {"type": "object", "properties": {
        "text": _string(), "target": {"type": "string", "enum": ["fr", "de", "es"]}},
        "required": ["text", "target"], "additionalProperties": False},
    "order_pizza": {"type": "object", "properties": {
        "size": {"type": "string", "enum": ["small", "large"]},
        "toppings": {"type": "array", "items": {"type": "string",
                                                "enum": ["ham", "olives", "basil"]},
                     "maxItems": 3}},
        "required": ["size", "toppings"], "additionalProperties": False},
    "lookup_id": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
        "required": ["id"], "additionalProperties": False},
    "move_robot": {"type": "object", "properties": {
        "direction": {"type": "string", "enum": ["north", "south", "east", "west"]},
        "steps": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["direction", "steps"], "additionalProperties": False},
    "schedule": {"type": "object", "properties": {
        "day": {"type": "string", "enum": ["mon", "tue", "wed"]},
        "slots": {"type": "array", "items": {"type": "integer", "minimum": 8,
                                             "maximum": 17},
                  "minItems": 1, "maxItems": 2}},
        "required": ["day", "slots"], "additionalProperties": False},
    "feedback": {"type": "object", "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "comment": {"anyOf": [_string(20), {"type": "null"}]}},
        "required": ["score"], "additionalProperties": False},
    "resize_image": {"type": "object", "properties": {
        "width": {"type": "integer", "minimum": 1, "maximum": 999},
        "height": {"type": "integer", "minimum": 1, "maximum": 999},
        "keep_ratio": {"type": "boolean"}},
        "required": ["width", "height", "keep_ratio"], "additionalProperties": False},
}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema,
                                           "description": name.replace("_", " ")}}
         for name, schema in SCHEMAS.items()]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                         max_retries=0)


@pytest.fixture(scope="module")
def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key, max_retries=0)


def _half(count: int, odd: bool) -> range:
    """Every other schema: the OpenAI test forces the even ones by "required" and the odd
    ones by name, the Anthropic test the other way round, so each schema is forced in both
    dialects and both ways (the grammar is the same whatever the dialect) at half the
    generations."""
    return range(1 if odd else 0, count, 2)


def _valid(name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return args


# ---------------------------------------------------------------------------- openai


def test_openai_two_turn_tool_loop(client: openai.OpenAI, server: Server) -> None:
    first = client.chat.completions.create(model=server.model, messages=ASK, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=80, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) >= 1
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    _valid("get_weather", call.function.arguments)
    second = client.chat.completions.create(
        model=server.model, tools=[WEATHER], max_tokens=40, temperature=0,
        messages=[*ASK, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}],
        tool_choice="none",
    )
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # The call and its result are in the prompt (the tools are not: tool_choice "none").
    bare = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=1)
    assert second.usage is not None and bare.usage is not None
    assert second.usage.prompt_tokens > bare.usage.prompt_tokens + 20


@pytest.mark.parametrize("named", [False, True], ids=["required", "named"])
def test_openai_forced_calls_always_validate(client: openai.OpenAI, server: Server,
                                             named: bool) -> None:
    def one(i: int) -> None:
        name = TOOLS[i]["function"]["name"]
        choice: Any = ({"type": "function", "function": {"name": name}} if named
                       else "required")
        r = client.chat.completions.create(
            model=server.model, tools=TOOLS if named else TOOLS[i:i + 3], tool_choice=choice,
            messages=[{"role": "user", "content": f"Please use {name} for me."}],
            max_tokens=160, temperature=1.0, seed=i)
        calls = r.choices[0].message.tool_calls
        assert calls, r.choices[0]
        # Parallel calls allowed: a small model may repeat calls up to max_tokens; a call
        # cut short there is not reported.
        assert r.choices[0].finish_reason in ("tool_calls", "length")
        for call in calls:
            if named:
                assert call.function.name == name
            _valid(call.function.name, call.function.arguments)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, _half(len(TOOLS), named)))


def test_openai_stream_reassembles_to_the_same_call(client: openai.OpenAI,
                                                    server: Server) -> None:
    kwargs: dict[str, Any] = dict(model=server.model, messages=ASK, tools=TOOLS[:6],
                                  tool_choice="required", parallel_tool_calls=False,
                                  max_tokens=120, temperature=0)
    plain = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        chunks = [event for event in stream if event.type == "chunk"]
        streamed = stream.get_final_completion().choices[0]
    fragments = [tc for e in chunks for c in e.chunk.choices for tc in c.delta.tool_calls or ()]
    assert len(fragments) > 1  # a first fragment with the name, then the arguments
    assert fragments[0].id and fragments[0].function and fragments[0].function.name
    assert streamed.finish_reason == plain.finish_reason == "tool_calls"
    assert plain.message.tool_calls and streamed.message.tool_calls
    assert ([(c.function.name, json.loads(c.function.arguments))
             for c in streamed.message.tool_calls]
            == [(c.function.name, json.loads(c.function.arguments))
                for c in plain.message.tool_calls])
    assert streamed.message.tool_calls[0].id == fragments[0].id


def test_openai_no_parallel_calls_means_at_most_one(client: openai.OpenAI,
                                                    server: Server) -> None:
    for seed in range(4):
        r = client.chat.completions.create(
            model=server.model, tools=TOOLS[:4], tool_choice="required",
            parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed,
            messages=[{"role": "user", "content": "Call every tool you have, twice."}])
        assert len(r.choices[0].message.tool_calls or ()) == 1


def test_openai_auto_choice_answers_text_or_a_valid_call(client: openai.OpenAI,
                                                         server: Server) -> None:
    for seed in range(3):
        r = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS[:3],
                                           max_tokens=100, temperature=1.0, seed=seed)
        message = r.choices[0].message
        for call in message.tool_calls or ():
            _valid(call.function.name, call.function.arguments)
        assert message.tool_calls or message.content is not None


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    days: int = pydantic.Field(ge=1, le=7)


def test_openai_parse_with_a_pydantic_function_tool(client: openai.OpenAI,
                                                    server: Server) -> None:
    r = client.chat.completions.parse(
        model=server.model, messages=ASK, tools=[openai.pydantic_function_tool(Weather)],
        tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Weather)


def test_openai_tool_choice_errors_name_the_parameter(client: openai.OpenAI,
                                                      server: Server) -> None:
    # LlamaIndex always sends tool_choice: "auto" and "none" without tools are fine.
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=2,
                                           tool_choice=choice)
        assert r.choices[0].message.tool_calls is None
    bad: list[dict[str, Any]] = [
        {"tool_choice": "required"},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
    ]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=server.model, messages=ASK, max_tokens=2,
                                           **kwargs)
        assert err.value.param == "tool_choice"


# ---------------------------------------------------------------------------- anthropic

CLAUDE_WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
                  "input_schema": WEATHER_SCHEMA}
CLAUDE_TOOLS = [{"name": name, "description": name.replace("_", " "), "input_schema": schema}
                for name, schema in SCHEMAS.items()]


def test_anthropic_two_turn_tool_loop(claude: anthropic.Anthropic, server: Server) -> None:
    first = claude.messages.create(model=server.model, max_tokens=80, extra_body={"temperature": 0},
                                   messages=ASK, tools=[CLAUDE_WEATHER],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and uses[0].id.startswith("toolu_") and uses[0].name == "get_weather"
    _valid("get_weather", uses[0].input)
    second = claude.messages.create(
        model=server.model, max_tokens=40, extra_body={"temperature": 0},
        tools=[CLAUDE_WEATHER],
        messages=[*ASK, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": uses[0].id,
                       "content": "Sunny, 21 C"}]}],
        tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"] and second.content[0].text
    bare = claude.messages.count_tokens(model=server.model, messages=ASK)
    # The call and its result are in the prompt. Anthropic's input_tokens leaves out what
    # the prefix cache held, which the session server's other tests may have filled.
    prompt = second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0)
    assert prompt > bare.input_tokens + 20


@pytest.mark.parametrize("named", [False, True], ids=["any", "tool"])
def test_anthropic_forced_calls_always_validate(claude: anthropic.Anthropic, server: Server,
                                                named: bool) -> None:
    def one(i: int) -> None:
        name = CLAUDE_TOOLS[i]["name"]
        choice: Any = {"type": "tool", "name": name} if named else {"type": "any"}
        r = claude.messages.create(
            model=server.model, max_tokens=160, extra_body={"temperature": 1.0},
            tools=CLAUDE_TOOLS if named else CLAUDE_TOOLS[i:i + 3], tool_choice=choice,
            messages=[{"role": "user", "content": f"Please use {name} for me."}])
        uses = [b for b in r.content if b.type == "tool_use"]
        assert uses and r.stop_reason in ("tool_use", "max_tokens"), r
        for use in uses:
            if named:
                assert use.name == name
            _valid(use.name, use.input)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, _half(len(CLAUDE_TOOLS), not named)))


def test_anthropic_stream_reassembles_to_the_same_call(claude: anthropic.Anthropic,
                                                       server: Server) -> None:
    kwargs: dict[str, Any] = dict(model=server.model, max_tokens=120,
                                  extra_body={"temperature": 0},
                                  messages=ASK, tools=CLAUDE_TOOLS[:6],
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True})
    plain = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"
              and e.content_block.type == "tool_use"]
    partial = [e for e in events if e.type == "input_json" or (
        e.type == "content_block_delta" and e.delta.type == "input_json_delta")]
    assert len(starts) == 1 and starts[0].content_block.input == {} and partial
    assert final.stop_reason == plain.stop_reason == "tool_use"

    def calls(message: anthropic.types.Message) -> list[tuple[str, Any]]:
        return [(b.name, b.input) for b in message.content if b.type == "tool_use"]

    assert calls(final) == calls(plain) and len(calls(plain)) == 1
    assert [b.id for b in final.content if b.type == "tool_use"] == [starts[0].content_block.id]


def test_anthropic_no_parallel_tool_use_means_at_most_one(claude: anthropic.Anthropic,
                                                          server: Server) -> None:
    for _ in range(3):
        r = claude.messages.create(
            model=server.model, max_tokens=200, tools=CLAUDE_TOOLS[:4],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            messages=[{"role": "user", "content": "Call every tool you have, twice."}])
        assert len([b for b in r.content if b.type == "tool_use"]) == 1


def test_anthropic_count_tokens_counts_the_tools(claude: anthropic.Anthropic,
                                                 server: Server) -> None:
    bare = claude.messages.count_tokens(model=server.model, messages=ASK)
    with_tools = claude.messages.count_tokens(model=server.model, messages=ASK,
                                              tools=[CLAUDE_WEATHER])
    assert with_tools.input_tokens > bare.input_tokens + 20


# ---------------------------------------------------------------------------- upstreams

PASSING = "tools-upstream-2026-11-22"
PLAIN = "plain-upstream-2026-11-22"


@pytest.fixture(scope="module")
def front(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A tokenyard whose deployments are upstreams, both the session's tokenyard: one
    declares tools (they are passed on, its calls come back as OpenAI deltas), one not."""
    config = tmp_path_factory.mktemp("fleet") / "tokenyard.toml"
    config.write_text("".join(f"""
[[deployments]]
name = "{name}"
kind = "upstream"
urls = ["{server.base_url}/v1"]
model = "{server.model}"
token_env = "TOOLS_UPSTREAM_KEY"
capabilities = {json.dumps(caps)}
""" for name, caps in ((PASSING, ["chat", "tools"]), (PLAIN, ["chat"]))))
    with running_server("--config", str(config), "--no-auth",
                        env={"TOOLS_UPSTREAM_KEY": server.api_key or ""}) as (srv, _):
        yield srv


def test_upstream_that_declares_tools_gets_them_passed_on(front: Server) -> None:
    client = openai.OpenAI(base_url=front.base_url + "/v1", api_key="x", max_retries=0)
    kwargs: dict[str, Any] = dict(model=PASSING, messages=ASK, tools=[WEATHER],
                                  tool_choice="required", parallel_tool_calls=False,
                                  max_tokens=80, temperature=0)
    plain = client.chat.completions.create(**kwargs).choices[0]
    assert plain.finish_reason == "tool_calls" and plain.message.tool_calls
    assert plain.message.tool_calls[0].function.name == "get_weather"
    _valid("get_weather", plain.message.tool_calls[0].function.arguments)
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.message.tool_calls is not None
    assert ([(c.function.name, json.loads(c.function.arguments))
             for c in streamed.message.tool_calls]
            == [(c.function.name, json.loads(c.function.arguments))
                for c in plain.message.tool_calls])
    claude = anthropic.Anthropic(base_url=front.base_url, api_key="x", max_retries=0)
    with claude.messages.stream(model=PASSING, max_tokens=80, messages=ASK,
                                tools=[CLAUDE_WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True},
                                extra_body={"temperature": 0}) as events:
        message = events.get_final_message()
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather"
    _valid("get_weather", uses[0].input)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**{**kwargs, "model": PLAIN})
    assert refused.value.param == "tools"


def test_responses_on_an_upstream_go_through_its_chat_endpoint(front: Server) -> None:
    """POST /v1/responses for an upstream deployment: the conversation and the tools go to
    its chat endpoint, and its calls come back as function_call items."""
    client = openai.OpenAI(base_url=front.base_url + "/v1", api_key="x", max_retries=0)
    flat = {"type": "function", **WEATHER["function"]}
    r = client.responses.create(model=PASSING, input=ASK[0]["content"], tools=[flat],
                                tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=80, temperature=0)
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    _valid("get_weather", call.arguments)
    plain = client.responses.create(model=PLAIN, input="Say hello.", max_output_tokens=4,
                                    instructions="Be brief.")
    assert plain.output_text and plain.usage is not None
    assert plain.usage.input_tokens > 0 and 0 < plain.usage.output_tokens <= 4
