"""Every request field of POST /v1/responses that the specs define is known here.

The fields are read from the specs (Open Responses' `CreateResponseBody` and OpenAI's
`CreateResponse`, its `allOf` parts followed), not from the SDK: a property this table
has never heard of fails `test_every_spec_property_is_classified`. Each field is then
sent through HTTP and is honoured (its effect or its echo in the response is checked),
accepted without effect (a 200), or refused with a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conformance.spec import Spec, properties
from tests.conformance.test_responses import WEATHER, body, post, valid_error, valid_response
from tests.e2e.conftest import Server

Check = Callable[[httpx.Response], bool]


def _echo(name: str, value: Any) -> Check:
    return lambda r: r.json()[name] == value


def _logprobs(top: int) -> Check:
    def check(r: httpx.Response) -> bool:
        parts = r.json()["output"][0]["content"]
        return bool(parts[0]["logprobs"]) and all(
            len(p["top_logprobs"]) == top for p in parts[0]["logprobs"])
    return check


#: Marks `value` for the stored response's id (made once per module).
PREVIOUS = object()

HONOURED, NO_EFFECT, REFUSED = "honoured", "accepted without effect", "refused"

#: field → (what tokenyard does with it, a value to send, the check of an honoured one).
FIELDS: dict[str, tuple[str, Any, Check | None]] = {
    "model": (HONOURED, None, lambda r: bool(r.json()["model"])),
    "input": (HONOURED, "Say hi.", lambda r: r.json()["usage"]["input_tokens"] > 0),
    "instructions": (HONOURED, "Be brief.", _echo("instructions", "Be brief.")),
    "previous_response_id": (HONOURED, PREVIOUS, lambda r: bool(r.json()["previous_response_id"])),
    "include": (HONOURED, ["message.output_text.logprobs"], _logprobs(0)),
    "top_logprobs": (HONOURED, 2, _logprobs(2)),
    "tools": (HONOURED, [WEATHER], lambda r: r.json()["tools"][0]["name"] == "get_weather"),
    "tool_choice": (HONOURED, "none", _echo("tool_choice", "none")),
    "parallel_tool_calls": (HONOURED, False, _echo("parallel_tool_calls", False)),
    "max_tool_calls": (HONOURED, 1, _echo("max_tool_calls", 1)),
    "text": (HONOURED, {"format": {"type": "json_object"}},
             lambda r: r.json()["text"]["format"] == {"type": "json_object"}),
    "temperature": (HONOURED, 0.5, _echo("temperature", 0.5)),
    "top_p": (HONOURED, 0.5, _echo("top_p", 0.5)),
    "presence_penalty": (HONOURED, 0.5, _echo("presence_penalty", 0.5)),
    "frequency_penalty": (HONOURED, 0.25, _echo("frequency_penalty", 0.25)),
    "max_output_tokens": (HONOURED, 2, lambda r: r.json()["usage"]["output_tokens"] <= 2),
    "truncation": (HONOURED, "auto", _echo("truncation", "auto")),
    "store": (HONOURED, False, _echo("store", False)),
    "stream": (HONOURED, True,
               lambda r: r.headers["content-type"].startswith("text/event-stream")),
    "metadata": (HONOURED, {"team": "conformance"}, _echo("metadata", {"team": "conformance"})),
    "stream_options": (NO_EFFECT, {"include_obfuscation": False}, None),
    "safety_identifier": (NO_EFFECT, "user-1", None),
    "prompt_cache_key": (NO_EFFECT, "conformance", None),
    "service_tier": (NO_EFFECT, "auto", None),
    "user": (NO_EFFECT, "user-1", None),
    "background": (HONOURED, True, lambda r: r.json()["background"] is True
                   and r.json()["status"] == "queued"),
    "reasoning": (REFUSED, {"effort": "high"}, None),
}



def specproperties() -> set[str]:
    return (properties(Spec.load("openresponses"), "CreateResponseBody")
            | properties(Spec.load("openai"), "CreateResponse"))


def test_every_spec_property_is_classified() -> None:
    unknown = specproperties() - set(FIELDS)
    assert not unknown, f"request fields of the specs nobody classified: {sorted(unknown)}"


@pytest.fixture(scope="module")
def previous(server: Server) -> str:
    r = post(server, body(server))
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_each_field_is_honoured_accepted_or_refused_by_name(server: Server, previous: str,
                                                            name: str) -> None:
    kind, value, check = FIELDS[name]
    fields = body(server)
    if value is PREVIOUS:
        value = previous
    if value is not None:
        fields[name] = value
    if name == "stream":
        fields["max_output_tokens"] = 1
    r = post(server, fields)
    if kind == REFUSED:
        assert valid_error(r, 400, name)["param"] == name
        return
    assert r.status_code == 200, (name, r.text)
    if name != "stream":
        valid_response(r.json(), name)
    assert check is None or check(r), (name, r.text[:2000])
