"""Every request field OpenAI's spec defines for chat completions, legacy completions,
embeddings and moderations is known here.

The fields are read from the spec (`CreateChatCompletionRequest`, `CreateCompletionRequest`,
`CreateEmbeddingRequest`, `CreateModerationRequest`, their `allOf` parts followed), not
from the SDK: a property these tables have never heard of fails
`test_every_spec_property_is_classified`. Each field is then sent through HTTP and is
honoured (its effect checked where one shows in a few tokens), accepted without effect
(a 200), or refused with a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conformance.spec import Spec, properties
from tests.conformance.test_openai import (
    EMBEDDER,
    WEATHER,
    chat,
    completion,
    post,
    valid,
    valid_error,
)
from tests.e2e.conftest import Server

Check = Callable[[httpx.Response], bool]
HONOURED, NO_EFFECT, REFUSED = "honoured", "accepted without effect", "refused"
#: field → (what tokenyard does with it, a value to send, the check of an honoured one).
Table = dict[str, tuple[str, Any, Check | None]]


def _first(r: httpx.Response) -> dict[str, Any]:
    return dict(r.json()["choices"][0])


def _output_at_most(tokens: int) -> Check:
    return lambda r: 0 < r.json()["usage"]["completion_tokens"] <= tokens


def _streamed(r: httpx.Response) -> bool:
    return r.headers["content-type"].startswith("text/event-stream")


def _streamed_usage(r: httpx.Response) -> bool:
    return _streamed(r) and '"usage":{' in r.text.replace(" ", "")


#: Sampling fields both completions routes honour (their effect needs more than a few
#: tokens to show: the 200 and a valid body are checked).
SAMPLING: Table = {
    "temperature": (HONOURED, 0.5, None),
    "top_p": (HONOURED, 0.5, None),
    "presence_penalty": (HONOURED, 0.5, None),
    "frequency_penalty": (HONOURED, 0.5, None),
    "logit_bias": (HONOURED, {"1": -100}, None),
    "seed": (HONOURED, 7, None),
}

CHAT: Table = {
    "messages": (HONOURED, None, lambda r: r.json()["usage"]["prompt_tokens"] > 0),
    "model": (HONOURED, None, lambda r: bool(r.json()["model"])),
    "max_tokens": (HONOURED, 2, _output_at_most(2)),
    "max_completion_tokens": (HONOURED, 2, _output_at_most(2)),
    "n": (HONOURED, 2, lambda r: len(r.json()["choices"]) == 2),
    "logprobs": (HONOURED, True, lambda r: bool(_first(r)["logprobs"]["content"])),
    "top_logprobs": (HONOURED, 2, lambda r: all(
        len(t["top_logprobs"]) == 2 for t in _first(r)["logprobs"]["content"])),
    "tools": (HONOURED, [WEATHER], None),
    "tool_choice": (HONOURED, "none", lambda r: not _first(r)["message"].get("tool_calls")),
    "parallel_tool_calls": (HONOURED, False, None),
    "response_format": (HONOURED, {"type": "json_object"},
                        lambda r: _first(r)["message"]["content"].lstrip().startswith(("{", "["))),
    "stop": (HONOURED, ["\n"], lambda r: "\n" not in _first(r)["message"]["content"]),
    "stream": (HONOURED, True, _streamed),
    "stream_options": (HONOURED, {"include_usage": True}, _streamed_usage),
    **SAMPLING,
    "metadata": (NO_EFFECT, {"team": "conformance"}, None),
    "prediction": (NO_EFFECT, {"type": "content", "content": "Hi"}, None),
    "reasoning_effort": (NO_EFFECT, "low", None),
    "service_tier": (NO_EFFECT, "auto", None),
    "store": (NO_EFFECT, False, None),
    "user": (NO_EFFECT, "user-1", None),
    "audio": (REFUSED, {"voice": "alloy", "format": "wav"}, None),
    "modalities": (REFUSED, ["text", "audio"], None),
    "functions": (REFUSED, [{"name": "f", "parameters": {"type": "object"}}], None),
    "function_call": (REFUSED, {"name": "f"}, None),
    "web_search_options": (REFUSED, {}, None),
}

COMPLETION: Table = {
    "prompt": (HONOURED, None, lambda r: r.json()["usage"]["prompt_tokens"] > 0),
    "model": (HONOURED, None, lambda r: bool(r.json()["model"])),
    "max_tokens": (HONOURED, 2, _output_at_most(2)),
    "n": (HONOURED, 2, lambda r: len(r.json()["choices"]) == 2),
    "best_of": (HONOURED, 2, lambda r: len(r.json()["choices"]) == 1
                and r.json()["choices"][0]["logprobs"] is None),
    "echo": (HONOURED, True, lambda r: _first(r)["text"].startswith("Once upon a time")),
    "logprobs": (HONOURED, 2, lambda r: all(
        len(t) == 2 for t in _first(r)["logprobs"]["top_logprobs"])),
    "stop": (HONOURED, "\n", lambda r: "\n" not in _first(r)["text"]),
    "stream": (HONOURED, True, _streamed),
    "stream_options": (HONOURED, {"include_usage": True}, _streamed_usage),
    **SAMPLING,
    "user": (NO_EFFECT, "user-1", None),
    "suffix": (REFUSED, " The end.", None),
}

EMBEDDING: Table = {
    "input": (HONOURED, None, lambda r: len(r.json()["data"]) == 1),
    "model": (HONOURED, None, lambda r: r.json()["model"] == EMBEDDER),
    "encoding_format": (HONOURED, "base64",
                        lambda r: isinstance(r.json()["data"][0]["embedding"], str)),
    "dimensions": (HONOURED, 384, lambda r: len(r.json()["data"][0]["embedding"]) == 384),
    "user": (NO_EFFECT, "user-1", None),
}

MODERATION: Table = {
    "input": (HONOURED, None, lambda r: len(r.json()["results"]) == 1),
    "model": (HONOURED, "omni-moderation-latest", lambda r: bool(r.json()["model"])),
}

#: route → (spec path, request component, its table, a minimal body).
ROUTES: dict[str, tuple[str, str, Table, Callable[[Server], dict[str, Any]]]] = {
    "/v1/chat/completions": ("/chat/completions", "CreateChatCompletionRequest", CHAT,
                             lambda s: chat(s)),
    "/v1/completions": ("/completions", "CreateCompletionRequest", COMPLETION,
                        lambda s: completion(s)),
    "/v1/embeddings": ("/embeddings", "CreateEmbeddingRequest", EMBEDDING,
                       lambda s: {"model": EMBEDDER, "input": "Hello"}),
    "/v1/moderations": ("/moderations", "CreateModerationRequest", MODERATION,
                        lambda s: {"input": "Hello"}),
}
#: Fields that only mean something beside another one.
COMPANIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/chat/completions", "top_logprobs"): {"logprobs": True},
    ("/v1/chat/completions", "stream_options"): {"stream": True},
    ("/v1/completions", "stream_options"): {"stream": True},
    ("/v1/chat/completions", "stream"): {"max_tokens": 1},
    ("/v1/completions", "stream"): {"max_tokens": 1},
    ("/v1/chat/completions", "response_format"): {"max_tokens": 2},
}



@pytest.mark.parametrize("route", list(ROUTES))
def test_every_spec_property_is_classified(route: str) -> None:
    _, component, table, _ = ROUTES[route]
    spec_fields = properties(Spec.load("openai"), component)
    assert spec_fields - set(table) == set(), (
        f"request fields of {component} nobody classified: {sorted(spec_fields - set(table))}")
    assert set(table) - spec_fields == set(), f"not in {component}: {set(table) - spec_fields}"


CASES = [(route, name) for route, (_, _, table, _) in ROUTES.items() for name in table]


@pytest.mark.parametrize(("route", "name"), CASES)
def test_each_field_is_honoured_accepted_or_refused_by_name(server: Server, route: str,
                                                            name: str) -> None:
    path, _, table, base = ROUTES[route]
    kind, value, check = table[name]
    fields = base(server) | COMPANIONS.get((route, name), {})
    if name == "max_completion_tokens":
        fields.pop("max_tokens")
    if value is not None:
        fields[name] = value
    r = post(server, route, fields)
    if kind == REFUSED:
        assert valid_error(r, 400, f"{route} {name}")["param"] == name
        return
    assert r.status_code == 200, (route, name, r.text)
    if not _streamed(r) and name != "encoding_format":  # base64: test_openai's _decoded
        valid(r, path, f"{route} {name}")
    assert check is None or check(r), (route, name, r.text[:2000])
