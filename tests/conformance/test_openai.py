"""The OpenAI API (chat and legacy completions, embeddings, moderations) against OpenAI's
published spec, through HTTP on the session's server.

Every non-streamed 200 body is validated against the schema the spec gives for its route,
every chat stream chunk against `CreateChatCompletionStreamResponse` and every legacy
completion chunk against `CreateCompletionResponse` (the spec's stream of /completions is
that object, chunk by chunk), every error body against `ErrorResponse`. Requests ask for
a handful of tokens, so the file stays quick.
"""

from __future__ import annotations

import base64
import copy
import json
import struct
from typing import Any

import httpx
import pytest

from tests.conformance.keys import new_key
from tests.conformance.spec import Spec
from tests.e2e.conftest import Server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
HELLO = [{"role": "user", "content": "Say hi."}]
#: The embeddings model the session's server (as `make serve`) runs beside the chat one.
EMBEDDER = "all-minilm-l6-v2"


def _spec() -> Spec:
    return Spec.load("openai")


def post(server: Server, path: str, body: dict[str, Any], key: str | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    sent = {"Authorization": f"Bearer {key}"} if key else dict(server.headers)
    return httpx.post(server.base_url + path, json=body, headers=sent | (headers or {}),
                      timeout=120)


def chat(server: Server, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "messages": HELLO, "max_tokens": 4,
            "temperature": 0.0} | fields


def completion(server: Server, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "prompt": "Once upon a time", "max_tokens": 4,
            "temperature": 0.0} | fields


def valid(response: httpx.Response, path: str, what: str) -> dict[str, Any]:
    assert response.status_code == 200, (what, response.status_code, response.text)
    value = response.json()
    _spec().validate(value, _spec().response_schema(path, 200), what)
    return dict(value)


def valid_error(response: httpx.Response, status: int, what: str) -> dict[str, Any]:
    assert response.status_code == status, (what, response.status_code, response.text)
    error = response.json()
    _spec().validate(error, "ErrorResponse", what)
    return dict(error["error"])


def _resolved(chunk: dict[str, Any], component: str) -> dict[str, Any]:
    """`chunk` ready for the spec's schema. One conflict: the spec gives the streamed
    legacy completion the non-streamed `CreateCompletionResponse`, whose choices require a
    `finish_reason` of "stop", "length" or "content_filter"; a chunk before a choice's
    end has none, and OpenAI (and its SDK's streaming) sends null there. Such a null is
    checked to be on a chunk without usage and validated as "length" in a copy."""
    if component != "CreateCompletionResponse":
        return chunk
    checked = copy.deepcopy(chunk)
    for choice in checked["choices"]:
        if choice.get("finish_reason", "") is None:
            choice["finish_reason"] = "length"
    return checked


def stream(server: Server, path: str, body: dict[str, Any], component: str
           ) -> list[dict[str, Any]]:
    """The chunks of a streamed request, each validated against `component`; the stream
    must end with `data: [DONE]`, and each choice has exactly one finish reason."""
    chunks: list[dict[str, Any]] = []
    done = False
    with httpx.stream("POST", server.base_url + path, json=body | {"stream": True},
                      headers=server.headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            _spec().validate(_resolved(chunk, component), component,
                             f"{path} chunk {len(chunks)}")
            chunks.append(chunk)
    assert done and chunks
    finished = [c["index"] for chunk in chunks for c in chunk["choices"]
                if c.get("finish_reason") is not None]
    assert sorted(finished) == list(range(body.get("n", 1))), chunks
    return chunks


CHAT_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "system": {"messages": [{"role": "system", "content": "Answer in French."}, *HELLO]},
    "multi_turn": {"messages": [{"role": "user", "content": "My name is Ada."},
                                {"role": "assistant", "content": "Hello Ada."},
                                {"role": "user", "content": "What is my name?"}]},
    "tools_auto": {"tools": [WEATHER], "tool_choice": "auto"},
    "tools_required": {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 48,
                       "parallel_tool_calls": False},
    "tools_named": {"tools": [WEATHER], "max_tokens": 48, "parallel_tool_calls": False,
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "tool_result": {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."}]},
    "json_schema": {"max_tokens": 16, "response_format": {
        "type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                               "strict": True}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "n2": {"n": 2, "temperature": 1.0, "seed": 1},
    "logprobs": {"logprobs": True, "top_logprobs": 2},
    "stop": {"stop": ["\n", "."], "max_tokens": 8},
}


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_a_chat_completion_validates_against_the_spec(server: Server, case: str) -> None:
    fields = CHAT_CASES[case]
    value = valid(post(server, "/v1/chat/completions", chat(server, **fields)),
                  "/chat/completions", case)
    assert len(value["choices"]) == fields.get("n", 1)
    forced = fields.get("tool_choice") not in (None, "auto")
    if forced and value["choices"][0]["finish_reason"] != "length":
        calls = value["choices"][0]["message"]["tool_calls"]
        assert calls and all(c["function"]["name"] == "get_weather" for c in calls), value
    if "logprobs" in fields:
        content = value["choices"][0]["logprobs"]["content"]
        assert content and all(len(t["top_logprobs"]) == 2 for t in content)


@pytest.mark.parametrize(("case", "usage"), [
    ("plain", False), ("plain", True), ("n2", False), ("n2", True), ("tools_named", True),
    ("logprobs", False),
])
def test_every_chat_chunk_validates_against_the_spec(server: Server, case: str,
                                                     usage: bool) -> None:
    fields = dict(CHAT_CASES[case])
    if usage:
        fields["stream_options"] = {"include_usage": True}
    chunks = stream(server, "/v1/chat/completions", chat(server, **fields),
                    "CreateChatCompletionStreamResponse")
    indices = {c["index"] for chunk in chunks for c in chunk["choices"]}
    assert indices == set(range(fields.get("n", 1)))
    with_usage = [c for c in chunks if c.get("usage")]
    if usage:
        assert len(with_usage) == 1 and chunks[-1]["choices"] == [], chunks[-1]
    else:
        assert not with_usage


COMPLETION_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "n2": {"n": 2, "temperature": 1.0, "seed": 1},
    "logprobs": {"logprobs": 2},
    "stop": {"stop": "\n", "max_tokens": 8},
    "echo": {"echo": True},
}


@pytest.mark.parametrize("case", list(COMPLETION_CASES))
def test_a_completion_validates_against_the_spec(server: Server, case: str) -> None:
    fields = COMPLETION_CASES[case]
    value = valid(post(server, "/v1/completions", completion(server, **fields)),
                  "/completions", case)
    assert len(value["choices"]) == fields.get("n", 1)


@pytest.mark.parametrize(("case", "usage"), [("plain", True), ("n2", False),
                                             ("logprobs", False)])
def test_every_completion_chunk_validates_against_the_spec(server: Server, case: str,
                                                           usage: bool) -> None:
    fields = dict(COMPLETION_CASES[case])
    if usage:
        fields["stream_options"] = {"include_usage": True}
    chunks = stream(server, "/v1/completions", completion(server, **fields),
                    "CreateCompletionResponse")
    assert {c["index"] for chunk in chunks for c in chunk["choices"]} == set(
        range(fields.get("n", 1)))


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_embeddings_validate_against_the_spec(server: Server, encoding: str) -> None:
    body = {"model": EMBEDDER, "input": ["Hello", "world"], "encoding_format": encoding}
    r = post(server, "/v1/embeddings", body)
    if encoding == "base64":
        r = _decoded(r)
    value = valid(r, "/embeddings", encoding)
    assert len(value["data"]) == 2


def _decoded(response: httpx.Response) -> httpx.Response:
    """A conflict between the spec and the API it describes: `Embedding.embedding` is an
    array of numbers only, where `encoding_format: "base64"` (the SDK's default) answers
    each as a base64 string of little-endian float32s. Each string is checked to decode to
    a vector, which the copy validated carries."""
    assert response.status_code == 200, response.text
    value = response.json()
    for item in value["data"]:
        assert isinstance(item["embedding"], str), item
        raw = base64.b64decode(item["embedding"])
        item["embedding"] = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert item["embedding"], item
    return httpx.Response(200, json=value)


def test_moderations_validate_against_the_spec(server: Server) -> None:
    value = valid(post(server, "/v1/moderations", {"input": ["Hello", "I like cats"]}),
                  "/moderations", "moderations")
    assert len(value["results"]) == 2


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"bogus_field": 1}, "bogus_field"),
    ("/v1/chat/completions", {"temperature": 9}, "temperature"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/completions", {"bogus_field": 1}, "bogus_field"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/moderations", {"input": 5}, "input"),
])
def test_a_bad_field_is_a_400_naming_it(server: Server, path: str, body: dict[str, Any],
                                        param: str) -> None:
    base = completion(server) if path == "/v1/completions" else (
        chat(server) if path == "/v1/chat/completions" else {"model": EMBEDDER})
    error = valid_error(post(server, path, base | body), 400, f"{path} {body}")
    assert error["param"] == param


def test_a_bad_stream_request_is_a_400_before_any_chunk(server: Server) -> None:
    r = post(server, "/v1/chat/completions", chat(server, stream=True, temperature=9))
    assert valid_error(r, 400, "stream")["param"] == "temperature"


def test_an_unknown_model_is_a_404(server: Server) -> None:
    for path, body in [("/v1/chat/completions", chat(server)),
                       ("/v1/completions", completion(server)),
                       ("/v1/embeddings", {"input": "hi"})]:
        valid_error(post(server, path, body | {"model": "no-such-model"}), 404, path)


def test_a_body_over_the_cap_is_a_413(server: Server) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", headers=server.headers,
                   content=b"{\"pad\": \"" + b"x" * (5 << 20) + b"\"}", timeout=120)
    valid_error(r, 413, "413")



def test_401_403_and_429_are_in_the_api_s_error_shape(server: Server) -> None:
    path = "/v1/chat/completions"
    valid_error(httpx.post(server.base_url + path, json=chat(server), timeout=60), 401,
                "no key")
    valid_error(post(server, path, chat(server), key="sk-not-a-key"), 401, "bad key")
    scoped = new_key(server, models=["some-other-model"])
    valid_error(post(server, path, chat(server), key=scoped), 403, "403")
    valid_error(post(server, "/v1/embeddings", {"model": EMBEDDER, "input": "hi"},
                     key=scoped), 403, "403 embeddings")
    limited = new_key(server, rpm=1)
    assert post(server, path, chat(server), key=limited).status_code == 200
    valid_error(post(server, path, chat(server), key=limited), 429, "429")
