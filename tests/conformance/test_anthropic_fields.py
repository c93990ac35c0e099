"""Every property of the Anthropic spec's request schemas for POST /v1/messages
(`CreateMessageParams`) and POST /v1/messages/count_tokens (`CountMessageTokensParams`)
is known: honoured, accepted without effect, or refused with a 400 naming it. The spec
is the source: a property it adds that this file does not classify fails the test. Each
property is sent once, with a value the spec's own schema accepts, through HTTP on the
session's server."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conformance.spec import Spec
from tests.conformance.test_anthropic import WEATHER, headers
from tests.e2e.conftest import Server

HONOURED, WITHOUT_EFFECT, REFUSED = "honoured", "accepted without effect", "refused"
OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}

#: property → (how it is treated, a value the spec allows).
MESSAGES: dict[str, tuple[str, Any]] = {
    "model": (HONOURED, None),  # the session's model, set below
    "messages": (HONOURED, [{"role": "user", "content": "Say hi."}]),
    "max_tokens": (HONOURED, 1),
    "cache_control": (HONOURED, {"type": "ephemeral"}),
    "container": (REFUSED, "container_abc"),
    "inference_geo": (WITHOUT_EFFECT, "us"),
    "metadata": (WITHOUT_EFFECT, {"user_id": "user-1"}),
    "output_config": (HONOURED, {"format": {"type": "json_schema", "schema": OBJECT}}),
    "service_tier": (WITHOUT_EFFECT, "standard_only"),
    "stop_sequences": (HONOURED, ["zzz"]),
    "stream": (HONOURED, True),
    "system": (HONOURED, "Be brief."),
    "temperature": (HONOURED, 0.0),
    "thinking": (REFUSED, {"type": "enabled", "budget_tokens": 1024}),
    "tool_choice": (HONOURED, {"type": "auto"}),
    "tools": (HONOURED, [WEATHER]),
    "top_k": (HONOURED, 1),
    "top_p": (HONOURED, 0.5),
}
COUNT_TOKENS: dict[str, tuple[str, Any]] = {
    name: MESSAGES[name] for name in ("model", "messages", "cache_control", "output_config",
                                       "system", "thinking", "tool_choice", "tools")
}
ROUTES = {"/v1/messages": ("CreateMessageParams", MESSAGES),
          "/v1/messages/count_tokens": ("CountMessageTokensParams", COUNT_TOKENS)}


def _spec() -> Spec:
    return Spec.load("anthropic")


@pytest.mark.parametrize("path", ROUTES)
def test_every_spec_property_is_classified(path: str) -> None:
    component, known = ROUTES[path]
    ref = _spec().operation(path)["requestBody"]["content"]["application/json"]["schema"]
    assert ref["$ref"].endswith("/" + component)
    spec_fields = set(_spec().schemas[component]["properties"])
    assert spec_fields - set(known) == set(), f"{path}: properties nobody classified"
    assert set(known) - spec_fields == set(), f"{path}: classified but not in the spec"


def _body(server: Server, path: str, name: str, value: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": server.model,
                            "messages": [{"role": "user", "content": "Say hi."}]}
    if path == "/v1/messages":
        base |= {"max_tokens": 1, "temperature": 0.0}
    if name == "tool_choice":
        base["tools"] = [WEATHER]
    if name == "output_config" and path == "/v1/messages":
        base["max_tokens"] = 8
    if name != "model":
        base[name] = value
    return base


@pytest.mark.parametrize(("path", "name"),
                         [(p, n) for p, (_, fields) in ROUTES.items() for n in fields])
def test_each_property_is_honoured_accepted_or_refused_by_name(server: Server, path: str,
                                                               name: str) -> None:
    component, fields = ROUTES[path]
    treatment, value = fields[name]
    body = _body(server, path, name, value)
    _spec().validate(body, component, f"the test's own {name}")
    r = httpx.post(server.base_url + path, json=body, headers=headers(server.api_key),
                   timeout=120)
    if treatment == REFUSED:
        assert r.status_code == 400, (name, r.status_code, r.text)
        assert name in r.json()["error"]["message"], r.text
        return
    assert r.status_code == 200, (name, r.text)
    if path != "/v1/messages":
        assert r.json()["input_tokens"] > 0
    elif name == "stream":
        assert r.headers["content-type"].startswith("text/event-stream")
        assert "event: message_stop" in r.text
    elif name == "output_config":
        assert r.json()["content"][0]["text"].startswith("{"), r.text
    elif name == "max_tokens":
        assert r.json()["usage"]["output_tokens"] == 1, r.text


def test_thinking_that_asks_for_none_is_accepted(server: Server) -> None:
    body = _body(server, "/v1/messages", "thinking", {"type": "disabled"})
    r = httpx.post(server.base_url + "/v1/messages", json=body,
                   headers=headers(server.api_key), timeout=120)
    assert r.status_code == 200, r.text
