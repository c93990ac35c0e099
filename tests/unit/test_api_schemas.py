"""API schemas, conversions and errors: validation shapes, engine mapping, SDK acceptance.

The official `openai` and `anthropic` SDKs are the judges of the response shapes: bodies are
validated with the SDKs' own models, and whole exchanges run through the SDK clients over an
in-memory transport (no server, no engine) whose handler uses only the api package.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from anthropic.types import (
    Message,
    MessageTokensCount,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    RawMessageStreamEvent,
)
from openai.types import Completion as OpenAICompletion
from openai.types import Model as OpenAIModel
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatCompletionChunk
from pydantic import TypeAdapter

from tokenyard.api.anthropic.convert import (
    anthropic_messages,
    anthropic_request_to_engine,
    build_anthropic_message,
    new_message_id,
)
from tokenyard.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from tokenyard.api.anthropic.stream import AnthropicStream
from tokenyard.api.convert import now
from tokenyard.api.errors import anthropic_error_type, parse_body, render_anthropic, render_openai
from tokenyard.api.openai.convert import (
    Prompt,
    build_chat_completion,
    build_model_list,
    build_text_completion,
    chat_request_to_engine,
    completion_request_to_engine,
    new_chat_id,
    new_completion_id,
)
from tokenyard.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from tokenyard.api.openai.stream import ChatStream, CompletionStream
from tokenyard.api.sse import (
    SSE_DONE,
    anthropic_event,
    anthropic_stream_error,
    openai_stream_error,
    parse_sse,
    sse_data,
)
from tokenyard.errors import (
    APIError,
    body_too_large,
    context_length_exceeded,
    model_not_found,
    overloaded,
    rate_limited,
)
from tokenyard.text.prepare import fit, has_prefill
from tokenyard.wire.outputs import Completion, CompletionDelta, Logprob

USER = [{"role": "user", "content": "Hi"}]

# ---------------------------------------------------------------------------- a fake engine

# Token id → bytes; "ö" is split over two tokens (4, 5), as byte-level BPE does.
VOCAB: dict[int, bytes] = {
    0: b"Hel", 1: b"lo", 2: b",", 3: b" w", 4: b"\xc3", 5: b"\xb6", 6: b"rld", 7: b"!",
    8: b"<eos>",
}
# What the incremental detokenizer emits per token (nothing for the half character).
PIECES = ["Hel", "lo", ",", " w", "", "ö", "rld", "!"]
FULL_TEXT = "".join(PIECES)


def token_bytes(token_id: int) -> bytes:
    return VOCAB[token_id]


def fake_deltas(
    index: int = 0,
    with_logprobs: bool = False,
    finish: str = "stop",
    stop_reason: int | str | None = 8,
    chunk: int = 2,
) -> list[CompletionDelta]:
    """The engine's deltas for FULL_TEXT, `chunk` tokens per step."""
    ids = list(range(len(PIECES)))
    deltas = []
    for start in range(0, len(ids), chunk):
        step = ids[start : start + chunk]
        last = start + chunk >= len(ids)
        logprobs = None
        if with_logprobs:
            logprobs = [Logprob(t, -0.25 * (t + 1), [(t, -0.25 * (t + 1)), (8, -3.0)])
                        for t in step]
        deltas.append(CompletionDelta(
            index=index,
            text="".join(PIECES[t] for t in step),
            token_ids=step,
            logprobs=logprobs,
            finish_reason=finish if last else None,
            stop_reason=stop_reason if last else None,
        ))
    return deltas


def fake_completion(index: int = 0, **kwargs: Any) -> Completion:
    c = Completion(index=index)
    for d in fake_deltas(index=index, **kwargs):
        c.add(d)
    return c


# ---------------------------------------------------------------------------- helpers


def chat_error(body: Any) -> APIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as info:
        req = parse_body(ChatCompletionRequest, raw)
        chat_request_to_engine(req, vocab_size=len(VOCAB))
    return info.value


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, **extra}


def completion_error(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        req = parse_body(CompletionRequest, json.dumps(body).encode())
        completion_request_to_engine(req, vocab_size=len(VOCAB))
    return info.value


def messages_error(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        req = parse_body(MessagesRequest, json.dumps(body).encode())
        anthropic_request_to_engine(req)
    return info.value


# ---------------------------------------------------------------------------- OpenAI validation


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (chat(temperature="hot"), "temperature", "invalid_type"),
        (chat(max_tokens="5"), "max_tokens", "invalid_type"),
        (chat(stream="yes"), "stream", "invalid_type"),
        (chat(n=1.5), "n", "invalid_type"),
        (chat(stop=[1]), "stop.0", "invalid_type"),
        (chat(logit_bias={"5": "x"}), "logit_bias.5", "invalid_type"),
        ({"model": "tiny", "messages": "Hi"}, "messages", "invalid_type"),
        ({"model": "tiny", "messages": []}, "messages", "invalid_value"),
        ({"messages": USER}, "model", "missing_required_parameter"),
        ({"model": "tiny"}, "messages", "missing_required_parameter"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
         "messages.0.role", "invalid_value"),
        ({"model": "tiny", "messages": [{"role": "user"}]}, "messages.0.content", "invalid_value"),
        ({"model": "tiny", "messages": [{"role": "user", "content": 5}]},
         "messages.0.content", "invalid_type"),
        ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages.0.content.0.text", "missing_required_parameter"),
        ({"model": "tiny", "messages": [USER[0], {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}]}]},
         "messages.1.content.1.image_url.url", "invalid_value"),
        ({"model": "tiny", "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {}}]}]},
         "messages.0.content.0.type", "unsupported_value"),
        ({"model": "tiny", "messages": [{"role": "assistant", "content": None,
                                         "tool_calls": [{"id": "c"}]}]},
         "messages.0.tool_calls.0.function", "missing_required_parameter"),
        ({"model": "tiny", "messages": [{"role": "tool", "content": "r"}]},
         "messages.0.tool_call_id", "invalid_value"),
        (chat(tools=[{"type": "function", "function": {"name": "two words"}}]),
         "tools.0.function.name", "invalid_value"),
        (chat(tool_choice="required"), "tool_choice", "invalid_value"),
        (chat(response_format={"type": "xml"}), "response_format", "invalid_value"),
        (chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex",
         "invalid_value"),
        (chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
        (chat(modalities=["text", "audio"]), "modalities", "unsupported_parameter"),
        # Ranges: checked by SamplingParams, reported under the client's names.
        (chat(temperature=2.5), "temperature", "invalid_value"),
        (chat(top_p=0), "top_p", "invalid_value"),
        (chat(min_p=1.5), "min_p", "invalid_value"),
        (chat(top_k=-2), "top_k", "invalid_value"),
        (chat(presence_penalty=3), "presence_penalty", "invalid_value"),
        (chat(frequency_penalty=-3), "frequency_penalty", "invalid_value"),
        (chat(repetition_penalty=0), "repetition_penalty", "invalid_value"),
        (chat(max_tokens=0), "max_tokens", "invalid_value"),
        (chat(max_completion_tokens=0), "max_completion_tokens", "invalid_value"),
        (chat(n=0), "n", "invalid_value"),
        (chat(n=1000), "n", "invalid_value"),
        (chat(seed=2**70), "seed", "invalid_value"),
        (chat(logit_bias={"abc": 1}), "logit_bias", "invalid_value"),
        (chat(logit_bias={"3": 101}), "logit_bias", "invalid_value"),
        (chat(logit_bias={"99999": 1}), "logit_bias", "invalid_value"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
        (chat(top_logprobs=2), "top_logprobs", "invalid_value"),
        (chat(stop=[f"s{i}" for i in range(17)]), "stop", "invalid_value"),
    ],
)
def test_chat_validation_errors(body: dict[str, Any], param: str, code: str) -> None:
    err = chat_error(body)
    assert (err.status, err.type, err.param, err.code) == (
        400, "invalid_request_error", param, code
    )
    assert param in err.message
    status, raw, headers = render_openai(err)
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(raw) == {"error": {"message": err.message, "type": "invalid_request_error",
                                         "param": param, "code": code}}


@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b"",
        b"   ",
        b"[1, 2]",
        b'"just a string"',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff"}]}',
        b'{"model": "tiny", "temperature": NaN, "messages": []}',
        b'{"model": "tiny", "junk": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"model": "tiny", "messages": ' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}",
    ],
)
def test_malformed_bodies_are_400(raw: bytes) -> None:
    err = chat_error(raw)
    assert err.status == 400 and err.type == "invalid_request_error"


def test_body_over_the_cap_is_413() -> None:
    with pytest.raises(APIError) as info:
        parse_body(ChatCompletionRequest, b"{" + b" " * 2000 + b"}", max_bytes=1000)
    assert info.value.status == 413
    status, raw, _ = render_anthropic(info.value)
    assert status == 413
    assert json.loads(raw)["error"]["type"] == "request_too_large"


def test_an_unknown_top_level_field_is_refused_by_name() -> None:
    for schema, body in ((ChatCompletionRequest, chat(temprature=0.5)),
                         (CompletionRequest, {"model": "m", "prompt": "p", "foo": 1}),
                         (MessagesRequest, {"model": "m", "max_tokens": 1, "top_kk": 2,
                                            "messages": [{"role": "user", "content": "Hi"}]})):
        with pytest.raises(APIError) as refused:
            parse_body(schema, json.dumps(body).encode())
        assert refused.value.status == 400
        assert refused.value.param in ("temprature", "foo", "top_kk")
        assert refused.value.message.startswith("Unrecognized request argument supplied")


def test_an_unknown_field_named_by_a_non_ascii_digit_is_a_400_not_a_500() -> None:
    # "¹".isdigit() is true but int("¹") raises: found by the fuzzer (it was a 500).
    for name in ("¹", "0¹", "٣"):
        with pytest.raises(APIError) as refused:
            parse_body(MessagesRequest, json.dumps(
                {"model": "m", "max_tokens": 1, "messages": [], name: 1}).encode())
        assert refused.value.status == 400 and name in refused.value.message


def test_vllm_extras_reach_the_sampling_parameters() -> None:
    req = parse_body(ChatCompletionRequest, json.dumps(
        chat(ignore_eos=True, skip_special_tokens=False, min_tokens=3)).encode())
    _, params = chat_request_to_engine(req)
    assert params.ignore_eos and not params.skip_special_tokens and params.min_tokens == 3
    _, default = chat_request_to_engine(parse_body(ChatCompletionRequest,
                                                   json.dumps(chat()).encode()))
    assert not default.ignore_eos and default.skip_special_tokens
    _, anthropic = anthropic_request_to_engine(parse_body(MessagesRequest, json.dumps(
        {"model": "m", "max_tokens": 5, "ignore_eos": True,
         "messages": [{"role": "user", "content": "Hi"}]}).encode()))
    assert anthropic.ignore_eos  # a tokenyard extension there too, for benchmarks


def test_harmless_known_fields_and_values_are_accepted() -> None:
    body = chat(
        metadata={"k": "v"}, store=True, service_tier="auto", user="u", prompt_cache_key="p",
        safety_identifier="s", tools=[], tool_choice="none", response_format={"type": "text"},
        parallel_tool_calls=False, stream_options={"include_usage": True, "other": 1},
        stream=True, modalities=["text"],
    )
    req = parse_body(ChatCompletionRequest, json.dumps(body).encode())
    assert req.include_usage
    messages, params = chat_request_to_engine(req)
    assert messages == [{"role": "user", "content": "Hi"}]
    assert params.max_tokens is None and params.n == 1 and params.temperature == 1.0


def test_chat_conversion() -> None:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "system", "content": [{"type": "text", "text": "A"},
                                           {"type": "text", "text": "B"}]},
            {"role": "user", "content": "Hi", "name": "ann"},
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        "temperature": 0, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "max_tokens": 7,
        "max_completion_tokens": 9, "stop": "\n\n", "n": 3, "seed": 11,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
        "logit_bias": {"3": -100, "7": 5.5}, "logprobs": True, "top_logprobs": 4,
        "user": "u-1",
    }
    req = parse_body(ChatCompletionRequest, json.dumps(body).encode())
    messages, p = chat_request_to_engine(req, vocab_size=len(VOCAB))
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42"},
    ]
    assert p.greedy and p.top_p == 0.9 and p.top_k == 5 and p.min_p == 0.05
    assert p.max_tokens == 9  # max_completion_tokens wins over max_tokens
    assert p.stop == ["\n\n"] and p.n == 3 and p.seed == 11
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.logit_bias == {3: -100.0, 7: 5.5}
    assert p.logprobs == 4

    plain = parse_body(ChatCompletionRequest, json.dumps(chat(logprobs=True)).encode())
    assert chat_request_to_engine(plain)[1].logprobs == 0
    none = parse_body(ChatCompletionRequest, json.dumps(chat(stop=["", "x"])).encode())
    assert chat_request_to_engine(none)[1].logprobs is None
    assert chat_request_to_engine(none)[1].stop == ["x"]


# ---------------------------------------------------------------------------- completions


def test_completion_prompt_forms() -> None:
    def prompts(prompt: Any) -> list[Prompt]:
        req = parse_body(CompletionRequest, json.dumps({"model": "tiny", "prompt": prompt}))
        out, params = completion_request_to_engine(req)
        assert params.max_tokens == 16  # the legacy default
        return out

    assert prompts("Once") == ["Once"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts([[1, 2], [3]]) == [[1, 2], [3]]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [len(VOCAB)]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"best_of": 100, "prompt": ["a", "b"]}, "best_of"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"echo": True, "logprobs": 21}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 100, "prompt": ["a", "b"]}, "n"),
    ],
)
def test_completion_validation_errors(extra: dict[str, Any], param: str) -> None:
    body = {"model": "tiny", "prompt": "x", **extra}
    err = completion_error(body)
    assert err.status == 400 and err.param is not None
    assert err.param.split(".")[0] == param


# ---------------------------------------------------------------------------- Anthropic


def msg(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 32, "messages": USER, **extra}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny", "messages": USER}, "max_tokens"),
        (msg(max_tokens=0), "max_tokens"),
        (msg(max_tokens="5"), "max_tokens"),
        (msg(temperature=1.5), "temperature"),
        (msg(top_p=0), "top_p"),
        (msg(top_k=-1), "top_k"),
        (msg(messages=[]), "messages"),
        (msg(messages=[{"role": "tool", "content": "x"}]), "messages.0.role"),
        (msg(messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": ""}}]}]),
         "messages.0.content.0.source.media_type"),
        (msg(messages=[{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
         "messages.0.content.0.type"),
        (msg(messages=[USER[0], {"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]),
         "messages.1.content.0.type"),
        (msg(messages=[{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}]),
         "messages.0"),
        (msg(tools=[{"name": "f"}]), "tools.0.input_schema"),
        (msg(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
        (msg(tool_choice={"type": "any"}), "tool_choice"),
        (msg(system=[{"type": "image"}]), "system.0.type"),
        (msg(system=5), "system"),
        (msg(stop_sequences=[f"s{i}" for i in range(17)]), "stop_sequences"),
        (msg(metadata={"user_id": 5}), "metadata.user_id"),
    ],
)
def test_messages_validation_errors(body: dict[str, Any], param: str) -> None:
    err = messages_error(body)
    assert err.status == 400 and err.param == param
    status, raw, _ = render_anthropic(err, request_id="req_1")
    parsed = json.loads(raw)
    assert status == 400
    assert parsed["type"] == "error" and parsed["request_id"] == "req_1"
    assert parsed["error"]["type"] == "invalid_request_error"
    assert param in parsed["error"]["message"]


def test_messages_conversion() -> None:
    body = msg(
        system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief.",
                                                 "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Count"},
            {"role": "assistant", "content": ""},
        ],
        stop_sequences=["\n\nHuman:", ""], temperature=0, top_p=0.8, top_k=3,
        metadata={"user_id": "u-9"}, stream=True, tool_choice={"type": "auto"},
        thinking={"type": "disabled"}, service_tier="auto",
    )
    req = parse_body(MessagesRequest, json.dumps(body))
    messages, p = anthropic_request_to_engine(req)
    assert messages == [
        {"role": "system", "content": "Be\nbrief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Count"},
        {"role": "assistant", "content": ""},
    ]
    assert has_prefill(messages)
    assert p.max_tokens == 32 and p.greedy and p.top_p == 0.8 and p.top_k == 3
    assert p.stop == ["\n\nHuman:"] and p.n == 1 and p.logprobs is None

    count = parse_body(CountTokensRequest, json.dumps({"model": "tiny", "messages": USER,
                                                       "system": "S"}))
    assert anthropic_messages(count) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
    ]


def test_fit_fills_max_tokens_from_the_window_and_refuses_what_does_not_fit() -> None:
    params = chat_request_to_engine(parse_body(ChatCompletionRequest, json.dumps(chat())))[1]
    assert params.max_tokens is None
    assert fit(100, params, "messages", 2048).max_tokens == 1948
    with pytest.raises(APIError) as full:
        fit(2048, params, "messages", 2048)
    assert (full.value.code, full.value.param) == ("context_length_exceeded", "messages")
    capped = replace(params, max_tokens=49)
    assert fit(1999, capped, "max_tokens", 2048) is capped
    with pytest.raises(APIError) as over:
        fit(2000, capped, "max_completion_tokens", 2048)
    assert over.value == context_length_exceeded(2048, 2000, 49, param="max_completion_tokens")


# ---------------------------------------------------------------------------- errors


def test_error_types_per_status() -> None:
    expected_openai = {400: "invalid_request_error", 401: "authentication_error",
                       403: "permission_error", 404: "not_found_error",
                       429: "rate_limit_error", 500: "server_error",
                       503: "service_unavailable_error"}
    for status, kind in expected_openai.items():
        assert APIError(status, "m").type == kind
    expected_anthropic = {400: "invalid_request_error", 401: "authentication_error",
                          403: "permission_error", 404: "not_found_error",
                          413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                          529: "overloaded_error", 503: "overloaded_error", 418:
                          "invalid_request_error", 502: "api_error"}
    for status, kind in expected_anthropic.items():
        assert anthropic_error_type(status) == kind


def test_special_errors() -> None:
    err = model_not_found("gpt-9")
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert json.loads(render_anthropic(err).body)["error"]["type"] == "not_found_error"

    err = context_length_exceeded(2048, 2000, 100)
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert "2048" in err.message and "2000" in err.message and "100" in err.message

    busy = overloaded(2.2)
    status, raw, headers = render_openai(busy)
    assert status == 503 and headers["retry-after"] == "3"
    assert json.loads(raw)["error"]["code"] == "server_is_overloaded"
    status, raw, headers = render_anthropic(busy)
    assert status == 529 and headers["retry-after"] == "3"
    assert json.loads(raw) == {"type": "error", "error": {
        "type": "overloaded_error", "message": busy.message}, "request_id": None}

    assert body_too_large(10, 20).status == 413
    assert rate_limited("slow down", 0.1).headers == {"retry-after": "1"}


# ---------------------------------------------------------------------------- response shapes


def test_chat_completion_parses_with_the_sdk() -> None:
    completions = [fake_completion(0, with_logprobs=True),
                   fake_completion(1, with_logprobs=True, finish="length", stop_reason=None)]
    body = build_chat_completion(
        id=new_chat_id(), model="tiny", created=now(),
        completions=completions, prompt_tokens=12, cached_tokens=8, token_bytes=token_bytes,
        system_fingerprint="fp_test",
    )
    raw = json.loads(body.model_dump_json())
    parsed = OpenAIChatCompletion.model_validate(raw)
    assert parsed.object == "chat.completion" and parsed.id.startswith("chatcmpl-")
    assert [c.finish_reason for c in parsed.choices] == ["stop", "length"]
    assert parsed.choices[0].message.content == FULL_TEXT
    assert parsed.choices[0].message.role == "assistant"
    assert raw["choices"][0]["message"]["refusal"] is None
    assert parsed.usage is not None
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens,
            parsed.usage.total_tokens) == (12, 16, 28)
    assert parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 8
    assert parsed.usage.completion_tokens_details is not None
    assert parsed.usage.completion_tokens_details.reasoning_tokens == 0
    lp = parsed.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == len(PIECES)
    assert lp.content[0].token == "Hel" and lp.content[0].bytes == list(b"Hel")
    assert lp.content[4].token == "bytes:\\xc3" and lp.content[4].bytes == [0xC3]
    assert [t.token for t in lp.content[0].top_logprobs] == ["Hel", "<eos>"]
    # Bytes of all tokens rebuild the text exactly.
    assert bytes(b for t in lp.content for b in (t.bytes or [])).decode() == FULL_TEXT


def test_text_completion_parses_with_the_sdk() -> None:
    body = build_text_completion(
        id=new_completion_id(), model="tiny", created=1,
        completions=[[fake_completion(0, with_logprobs=True)],
                     [fake_completion(0, finish="length")]],
        n=1, prompt_tokens=6, token_bytes=token_bytes, echo_prompts=["P: ", "Q"],
    )
    parsed = OpenAICompletion.model_validate(json.loads(body.model_dump_json()))
    assert parsed.object == "text_completion"
    assert [c.index for c in parsed.choices] == [0, 1]
    assert parsed.choices[0].text == "P: " + FULL_TEXT
    assert parsed.choices[1].finish_reason == "length"
    logprobs = parsed.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.text_offset == [3, 6, 8, 9, 11, 11, 12, 15]
    assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] == {
        "Hel": -0.25, "<eos>": -3.0}


def test_chat_chunks_parse_with_the_sdk() -> None:
    stream = ChatStream(id="chatcmpl-x", model="tiny", created=5, token_bytes=token_bytes)
    chunks = stream.role_chunks(2)
    for d0, d1 in zip(fake_deltas(0, with_logprobs=True), fake_deltas(1), strict=True):
        chunks += stream.delta_chunks(d0) + stream.delta_chunks(d1)
    chunks.append(stream.usage_chunk(10, 16, 4))
    raws = [json.loads(c.model_dump_json()) for c in chunks]
    parsed = [OpenAIChatCompletionChunk.model_validate(r) for r in raws]
    assert raws[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert all(r["object"] == "chat.completion.chunk" for r in raws)
    assert all(r["usage"] is None for r in raws[:-1])
    text = {0: "", 1: ""}
    finishes = {}
    for chunk in parsed[:-1]:
        (choice,) = chunk.choices
        text[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
            assert raws[parsed.index(chunk)]["choices"][0]["delta"] == {}
    assert text == {0: FULL_TEXT, 1: FULL_TEXT} and finishes == {0: "stop", 1: "stop"}
    last = parsed[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.total_tokens == 26
    assert last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens == 4


def test_completion_chunks_carry_offsets_across_steps() -> None:
    stream = CompletionStream(id="cmpl-x", model="tiny", created=5, n=2,
                              token_bytes=token_bytes)
    chunks = stream.echo_chunks(1, "Q: ")
    for d in fake_deltas(1, with_logprobs=True, chunk=3):
        chunks += stream.delta_chunks(d, prompt_index=1)
    raws = [json.loads(c.model_dump_json()) for c in chunks]
    assert [r["choices"][0]["index"] for r in raws[:2]] == [2, 3]
    mine = [r["choices"][0] for r in raws[2:]]
    assert all(c["index"] == 3 for c in mine)
    assert "".join(c["text"] for c in mine) == FULL_TEXT and mine[-1]["finish_reason"] == "stop"
    offsets = [o for c in mine for o in c["logprobs"]["text_offset"]]
    assert offsets == [3, 6, 8, 9, 11, 11, 12, 15]
    usage = stream.usage_chunk(3, 8)
    assert OpenAICompletion.model_validate(json.loads(usage.model_dump_json())).choices == []


def test_model_list_parses_with_the_sdk() -> None:
    body = json.loads(build_model_list([("tiny", 1700000000, "tokenyard")])
                      .model_dump_json())
    assert body["object"] == "list"
    model = OpenAIModel.model_validate(body["data"][0])
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "tokenyard")


def test_anthropic_message_parses_with_the_sdk() -> None:
    for finish, stop_reason, expect in [
        ("stop", 8, ("end_turn", None)),
        ("length", None, ("max_tokens", None)),
        ("stop", "!", ("stop_sequence", "!")),
        ("stop", "not-requested", ("end_turn", None)),
    ]:
        body = build_anthropic_message(
            id=new_message_id(), model="tiny",
            completion=fake_completion(finish=finish, stop_reason=stop_reason),
            prompt_tokens=20, cached_tokens=16, stop_sequences=["!"],
        )
        parsed = Message.model_validate(json.loads(body.model_dump_json()))
        assert parsed.id.startswith("msg_") and parsed.type == "message"
        assert (parsed.stop_reason, parsed.stop_sequence) == expect
        assert parsed.content[0].type == "text" and parsed.content[0].text == FULL_TEXT
        assert (parsed.usage.input_tokens, parsed.usage.output_tokens,
                parsed.usage.cache_read_input_tokens,
                parsed.usage.cache_creation_input_tokens) == (4, 8, 16, 0)
    count = MessageTokensCount.model_validate({"input_tokens": 7})
    assert count.input_tokens == 7


def test_anthropic_events_parse_with_the_sdk() -> None:
    stream = AnthropicStream(id="msg_x", model="tiny", stop_sequences=["!"])
    events = stream.start_events(prompt_tokens=9, cached_tokens=0)
    for d in fake_deltas(finish="stop", stop_reason="!"):
        events += stream.delta_events(d, prompt_tokens=9, output_tokens=8)
    types = [e.type for e in events]
    assert types == ["message_start", "content_block_start", "ping"] + [
        "content_block_delta"] * 4 + ["content_block_stop", "message_delta", "message_stop"]
    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    sdk_types = {
        "message_start": RawMessageStartEvent, "content_block_start": RawContentBlockStartEvent,
        "content_block_delta": RawContentBlockDeltaEvent,
        "content_block_stop": RawContentBlockStopEvent,
        "message_delta": RawMessageDeltaEvent, "message_stop": RawMessageStopEvent,
    }
    for event in events:
        raw = json.loads(event.model_dump_json())
        if event.type == "ping":
            assert raw == {"type": "ping"}
            continue
        assert isinstance(adapter.validate_python(raw), sdk_types[event.type])
    delta = RawMessageDeltaEvent.model_validate(json.loads(events[-2].model_dump_json()))
    assert delta.delta.stop_reason == "stop_sequence" and delta.delta.stop_sequence == "!"
    assert delta.usage.output_tokens == 8 and delta.usage.input_tokens == 9


# ---------------------------------------------------------------------------- SDK end to end

MODEL = "tiny"


def _respond(err: APIError, anthropic_route: bool) -> httpx2.Response:
    rendered = render_anthropic(err) if anthropic_route else render_openai(err)
    return httpx2.Response(rendered.status, content=rendered.body, headers=rendered.headers)


def fake_server(request: httpx2.Request) -> httpx2.Response:
    """A stand-in for the routes, built from the api package alone."""
    path = request.url.path
    anthropic_route = path.startswith("/v1/messages")
    try:
        if path == "/v1/chat/completions":
            return _chat(request.content)
        if path == "/v1/messages":
            return _messages(request.content)
        if path == "/v1/messages/count_tokens":
            req = parse_body(CountTokensRequest, request.content)
            count = sum(len(m["content"]) for m in anthropic_messages(req))
            return httpx2.Response(200, json={"input_tokens": count})
        raise APIError(404, f"No route {path}")
    except APIError as err:
        return _respond(err, anthropic_route)


def _chat(content: bytes) -> httpx2.Response:
    req = parse_body(ChatCompletionRequest, content)
    _, params = chat_request_to_engine(req)
    if req.model != MODEL:
        raise model_not_found(req.model)
    if req.user == "overload":
        raise overloaded(1)
    deltas = [fake_deltas(i, with_logprobs=params.logprobs is not None)
              for i in range(params.n)]
    if not req.stream:
        completions = [fake_completion(i) for i in range(params.n)]
        body = build_chat_completion(
            id=new_chat_id(), model=MODEL, created=now(),
            completions=completions, prompt_tokens=5, cached_tokens=2, token_bytes=token_bytes,
        )
        return httpx2.Response(200, content=body.model_dump_json(),
                               headers={"content-type": "application/json"})
    stream = ChatStream(id=new_chat_id(), model=MODEL, created=now(), token_bytes=token_bytes)
    out = [sse_data(c) for c in stream.role_chunks(params.n)]
    for step in zip(*deltas, strict=True):
        for d in step:
            out += [sse_data(c) for c in stream.delta_chunks(d)]
    if req.user == "fail-midway":
        out.append(openai_stream_error(overloaded(None, "replica lost")))
    elif req.include_usage:
        out.append(sse_data(stream.usage_chunk(5, 8 * params.n, 2)))
    out.append(SSE_DONE)
    return httpx2.Response(200, content=b"".join(out),
                           headers={"content-type": "text/event-stream"})


def _messages(content: bytes) -> httpx2.Response:
    req = parse_body(MessagesRequest, content)
    _, params = anthropic_request_to_engine(req)
    if req.model != MODEL:
        raise model_not_found(req.model)
    user = req.metadata.user_id if req.metadata else None
    if user == "overload":
        raise overloaded(1)
    finish, stop = ("stop", "!") if params.stop else ("length", None)
    if not req.stream:
        body = build_anthropic_message(
            id=new_message_id(), model=MODEL,
            completion=fake_completion(finish=finish, stop_reason=stop),
            prompt_tokens=5, cached_tokens=2, stop_sequences=params.stop,
        )
        return httpx2.Response(200, content=body.model_dump_json(),
                               headers={"content-type": "application/json"})
    stream = AnthropicStream(id=new_message_id(), model=MODEL, stop_sequences=params.stop)
    out = [anthropic_event(e) for e in stream.start_events(5, 2)]
    produced = 0
    for d in fake_deltas(finish=finish, stop_reason=stop):
        produced += len(d.token_ids)
        out += [anthropic_event(e) for e in stream.delta_events(d, 5, produced, 2)]
        if user == "fail-midway":
            out.append(anthropic_stream_error(overloaded(None, "replica lost")))
            break
    return httpx2.Response(200, content=b"".join(out),
                           headers={"content-type": "text/event-stream"})


def _client(factory: Callable[..., Any]) -> Any:
    transport = httpx2.MockTransport(fake_server)
    return factory(api_key="sk-test", base_url="http://tokenyard.test/v1"
                   if factory is openai.OpenAI else "http://tokenyard.test",
                   max_retries=0, http_client=httpx2.Client(transport=transport))


def test_openai_sdk_end_to_end() -> None:
    client = _client(openai.OpenAI)
    reply = client.chat.completions.create(model=MODEL, messages=USER, n=2, logprobs=True)
    assert [c.message.content for c in reply.choices] == [FULL_TEXT, FULL_TEXT]
    assert reply.usage.prompt_tokens_details.cached_tokens == 2

    pieces: dict[int, str] = {}
    usage = None
    with client.chat.completions.create(
        model=MODEL, messages=USER, n=2, stream=True, logprobs=True, top_logprobs=1,
        stream_options={"include_usage": True},
    ) as stream:
        for chunk in stream:
            for choice in chunk.choices:
                pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
            usage = chunk.usage or usage
    assert pieces == {0: FULL_TEXT, 1: FULL_TEXT}
    assert usage is not None and usage.completion_tokens == 16

    with pytest.raises(openai.APIError, match="replica lost"):
        for _ in client.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                                user="fail-midway"):
            pass
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=USER, temperature=9)
    assert bad.value.param == "temperature" and bad.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=USER, functions=[{"name": "f"}])
    assert bad.value.param == "functions"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=USER)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.InternalServerError) as busy:
        client.chat.completions.create(model=MODEL, messages=USER, user="overload")
    assert busy.value.status_code == 503
    assert busy.value.response.headers["retry-after"] == "1"


def test_anthropic_sdk_end_to_end() -> None:
    client = _client(anthropic.Anthropic)
    reply = client.messages.create(model=MODEL, max_tokens=16, messages=USER,
                                   stop_sequences=["!"])
    assert reply.content[0].text == FULL_TEXT
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "!")
    assert (reply.usage.input_tokens, reply.usage.cache_read_input_tokens) == (3, 2)

    with client.messages.stream(model=MODEL, max_tokens=16, messages=USER) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == FULL_TEXT and final.content[0].text == FULL_TEXT
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert final.usage.input_tokens == 3 and final.usage.cache_read_input_tokens == 2

    count = client.messages.count_tokens(model=MODEL, messages=USER, system="S")
    assert count.input_tokens == 3

    with (
        pytest.raises(anthropic.APIStatusError, match="replica lost"),
        client.messages.stream(model=MODEL, max_tokens=16, messages=USER,
                               metadata={"user_id": "fail-midway"}) as stream,
    ):
        for _ in stream:
            pass
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=0, messages=USER)
    body: Any = bad.value.body
    assert body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=USER)
    with pytest.raises(anthropic.InternalServerError) as busy:
        client.messages.create(model=MODEL, max_tokens=5, messages=USER,
                               metadata={"user_id": "overload"})
    assert busy.value.status_code == 529
    body = busy.value.body
    assert body["error"]["type"] == "overloaded_error"


def test_sse_stream_of_a_chat_parses_back() -> None:
    stream = ChatStream(id="chatcmpl-1", model="tiny", created=1)
    raw = b"".join(sse_data(c) for d in fake_deltas() for c in stream.delta_chunks(d))
    raw += SSE_DONE
    events = list(parse_sse([raw]))
    assert events[-1].is_done
    text = "".join(e.json()["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == FULL_TEXT


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "model": "other", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi", "content": "ho"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
    b'"response_format": {"type": "json_object", "type": "text"}}',
])
def test_a_key_twice_in_one_object_is_a_400_naming_it(raw: bytes) -> None:
    with pytest.raises(APIError) as info:
        parse_body(ChatCompletionRequest, raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"
    assert "appears twice" in info.value.message
    # the same keys once each are fine
    parse_body(ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "user", '
               b'"content": "hi"}], "response_format": {"type": "json_object"}}')


def test_a_validator_message_with_its_own_period_is_not_doubled() -> None:
    from pydantic import BaseModel, field_validator

    class Body(BaseModel):
        size: int

        @field_validator("size")
        @classmethod
        def positive(cls, value: int) -> int:
            if value <= 0:
                raise ValueError("It must be positive.")
            return value

    with pytest.raises(APIError) as info:
        parse_body(Body, b'{"size": -1}')
    assert info.value.message.endswith("must be positive.")
    assert ".." not in info.value.message
