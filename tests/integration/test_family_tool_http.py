"""A deployment's tool-call and reasoning parsers through HTTP: a scripted replica writes
calls in Mistral's and Llama 3's syntax and Qwen3's `<think>` reasoning (token ids of the
embedded tokenizer, as an engine would stream them). /v1/chat/completions and
/v1/messages return the calls as tool calls, whole and streamed (the default Hermes
parser leaves the same text as text); chat returns the thinking as `reasoning_content`
with its `reasoning_tokens` counted, /v1/messages as a thinking block with its
`thinking_tokens`."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web

from tests.conformance.spec import Spec
from tests.conformance.test_anthropic import valid_message, validate_event
from tokenyard.api.app import AppState, make_app
from tokenyard.config import default_cache_dir
from tokenyard.deployments import BalancerSpec, DeploymentSpec
from tokenyard.gateway.kinds import build_served
from tokenyard.gateway.kinds import replica_client as make_client
from tokenyard.gateway.served import now
from tokenyard.text.model_files import load_tokenizer
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.protocol import dumps

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
MISTRAL = 'Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def _replica(output: str) -> web.Application:
    ids = load_tokenizer(None, default_cache_dir()).encode(output)

    async def info(_: web.Request) -> web.Response:
        return web.json_response({
            "model": "scripted", "max_model_len": 2048, "vocab_size": 49152,
            "eos_token_ids": [2], "block_size": 16, "num_kv_blocks": 64})

    async def generate(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(0, len(ids), 3):  # a few tokens a delta, as a busy engine sends
            last = i + 3 >= len(ids)
            await response.write(dumps({
                "new_token_ids": ids[i:i + 3], "new_logprobs": None,
                "finish_reason": "stop" if last else None, "stop_reason": None,
                "num_prompt_tokens": 5, "num_cached_tokens": 0}) + b"\n")
        return response

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/v1/engine/info", info)
    app.router.add_post("/v1/engine/generate", generate)
    app.router.add_get("/healthz", health)
    return app


async def _ask(output: str, parser: str, path: str, body: dict[str, Any],
               reasoning: str = "auto", template: str | None = None) -> tuple[int, bytes]:
    replica = web.AppRunner(_replica(output))
    await replica.setup()
    await web.TCPSite(replica, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{replica.addresses[0][1]}"
    client = make_client(url)
    spec = DeploymentSpec("scripted", "engine", urls=(url,),
                          capabilities=frozenset({"chat", "tools"}), max_output_tokens=256,
                          max_tool_calls=8, tool_call_parser=parser,
                          reasoning_parser=reasoning)
    tokenizers = {}
    if template is not None:  # the embedded tokenizer under another chat template
        base = load_tokenizer(None, default_cache_dir())
        tokenizers[None] = Tokenizer(base.backend, replace(base._info, chat_template=template))
    served = await build_served(spec, [(url, client)], default_cache_dir(),
                                balancer=BalancerSpec(queue_timeout_s=0),
                                tokenizers=tokenizers)
    front = web.AppRunner(make_app(AppState.single(served, now())))
    await front.setup()
    await web.TCPSite(front, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{front.addresses[0][1]}{path}", json=body) as r:
            return r.status, await r.read()
    finally:
        await front.cleanup()
        await replica.cleanup()


def _chat(output: str, parser: str, stream: bool = False) -> tuple[int, bytes]:
    body = {"model": "scripted", "messages": [{"role": "user", "content": "Weather?"}],
            "tools": TOOLS, "stream": stream}
    return asyncio.run(_ask(output, parser, "/v1/chat/completions", body))


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.split(b"\n")
            if line.startswith(b"data: {")]


def test_mistral_calls_come_back_as_tool_calls() -> None:
    status, raw = _chat(MISTRAL, "mistral")
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_streamed_llama3_calls_come_back_as_tool_call_deltas() -> None:
    status, raw = _chat(LLAMA3, "llama3_json", stream=True)
    assert status == 200, raw
    deltas = [c["delta"] for e in _events(raw) for c in e.get("choices", [])]
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(t["function"].get("arguments") or "" for t in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert not "".join(d.get("content") or "" for d in deltas).strip()
    assert [c["finish_reason"] for e in _events(raw) for c in e.get("choices", [])
            if c.get("finish_reason")] == ["tool_calls"]


def test_anthropic_messages_get_tool_use_blocks() -> None:
    body = {"model": "scripted", "max_tokens": 64, "tools": ANTHROPIC_TOOLS,
            "messages": [{"role": "user", "content": "Weather?"}]}
    status, raw = asyncio.run(_ask(MISTRAL, "mistral", "/v1/messages", body))
    assert status == 200, raw
    message = json.loads(raw)
    assert message["stop_reason"] == "tool_use"
    uses = [b for b in message["content"] if b["type"] == "tool_use"]
    assert [(b["name"], b["input"]) for b in uses] == [("get_weather", {"city": "Paris"})]


def test_without_the_family_parser_the_same_output_is_text() -> None:
    status, raw = _chat(MISTRAL, "auto")  # the embedded model's template: Hermes
    assert status == 200, raw
    message = json.loads(raw)["choices"][0]["message"]
    assert not message.get("tool_calls")
    assert "[TOOL_CALLS]" in message["content"]


THINKING = "<think>\nThe user asks for 6 times 7; that is 42.\n</think>\n\nIt is 42."


def _reasoning_tokens(output: str) -> int:
    """Tokens up to the one that completes </think>, counted by decoding prefixes."""
    tokenizer = load_tokenizer(None, default_cache_dir())
    ids = tokenizer.encode(output)
    return next(k for k in range(1, len(ids) + 1) if "</think>" in tokenizer.decode(ids[:k]))


def test_qwen3_thinking_goes_to_reasoning_content_with_its_tokens_counted() -> None:
    body = {"model": "scripted", "messages": [{"role": "user", "content": "6*7?"}]}
    status, raw = asyncio.run(_ask(THINKING, "auto", "/v1/chat/completions", body, "qwen3"))
    assert status == 200, raw
    reply = json.loads(raw)
    spec = Spec.load("openai")
    spec.validate(reply, spec.response_schema("/chat/completions", 200), "reasoning reply")
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == "\nThe user asks for 6 times 7; that is 42.\n"
    assert message["content"] == "\nIt is 42."
    details = reply["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] == _reasoning_tokens(THINKING)
    assert 0 < details["reasoning_tokens"] < reply["usage"]["completion_tokens"]

    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    status, raw = asyncio.run(_ask(THINKING, "auto", "/v1/chat/completions", stream, "qwen3"))
    assert status == 200, raw
    events = _events(raw)
    for event in events:
        spec.validate(event, "CreateChatCompletionStreamResponse", "reasoning chunk")
    deltas = [c["delta"] for e in events for c in e.get("choices", [])]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == \
        message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert events[-1]["usage"]["completion_tokens_details"] == details


def test_without_a_reasoning_parser_the_thinking_stays_in_the_content() -> None:
    body = {"model": "scripted", "messages": [{"role": "user", "content": "6*7?"}]}
    status, raw = asyncio.run(_ask(THINKING, "auto", "/v1/chat/completions", body, "none"))
    assert status == 200, raw
    reply = json.loads(raw)
    assert "reasoning_content" not in reply["choices"][0]["message"]
    assert reply["choices"][0]["message"]["content"] == THINKING
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


#: A chat template that opens the thinking block in the prompt (as QwQ's and
#: Qwen3-Thinking-2507's do): the reply starts inside it, with only </think> to come.
OPENS_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def test_a_block_the_prompt_opened_is_detected_from_the_template_and_the_prompt() -> None:
    output = "Six sevens.\n</think>\n\nIt is 42."
    body = {"model": "scripted", "messages": [{"role": "user", "content": "6*7?"}]}
    status, raw = asyncio.run(_ask(output, "auto", "/v1/chat/completions", body,
                                   template=OPENS_THINKING))  # reasoning_parser auto
    assert status == 200, raw
    reply = json.loads(raw)
    message = reply["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Six sevens.\n", "\nIt is 42.")
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == \
        _reasoning_tokens(output)


def test_anthropic_messages_get_a_thinking_block_whole_and_streamed() -> None:
    body = {"model": "scripted", "max_tokens": 64,
            "messages": [{"role": "user", "content": "6*7?"}]}
    status, raw = asyncio.run(_ask(THINKING, "auto", "/v1/messages", body, "qwen3"))
    assert status == 200, raw
    message = valid_message(json.loads(raw), "thinking message")
    assert [b["type"] for b in message["content"]] == ["thinking", "text"]
    thinking, text = message["content"]
    assert thinking["thinking"] == "\nThe user asks for 6 times 7; that is 42.\n"
    assert text["text"] == "\nIt is 42."
    tokens = message["usage"]["output_tokens_details"]["thinking_tokens"]
    assert tokens == _reasoning_tokens(THINKING)

    status, raw = asyncio.run(_ask(THINKING, "auto", "/v1/messages", {**body, "stream": True},
                                   "qwen3"))
    assert status == 200, raw
    events = _events(raw)
    for event in events:
        validate_event(event)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == thinking["thinking"]
    assert "".join(d.get("text", "") for d in deltas) == text["text"]
    (final,) = [e for e in events if e["type"] == "message_delta"]
    assert final["usage"]["output_tokens_details"]["thinking_tokens"] == tokens
