"""The Anthropic Messages API against the published spec, through HTTP on the session's
server.

Every non-streamed /v1/messages body is validated against the spec's `Message`, every
stream event against the `MessageStreamEvent` member its `type` names (the spec has no
component for `ping`, which carries only its type, nor for the `error` event, whose data
is the `ErrorResponse` body, as Anthropic's documentation shows it), every error body
against `ErrorResponse` (the response the spec gives for 4XX). Requests ask for a handful
of tokens, so the file stays quick.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conformance.keys import new_key
from tests.conformance.spec import Spec, sse_events
from tests.e2e.conftest import Server

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
VERSION = {"anthropic-version": "2023-06-01"}


def _spec() -> Spec:
    return Spec.load("anthropic")


def headers(key: str | None) -> dict[str, str]:
    """Anthropic's auth header, as the official SDK sends it (the session's server runs
    with auth on, so it has a key)."""
    assert key is not None
    return {"x-api-key": key} | VERSION


def post(server: Server, body: dict[str, Any], key: str | None = None,
         path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(server.base_url + path, json=body,
                      headers=headers(key or server.api_key), timeout=120)


def body(server: Server, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "max_tokens": 4, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Say hi."}]} | fields


#: What tokenyard adds to a body or the last stream event, where the spec's object is
#: open (README lists them): the stage durations, and behind the gateway the charge.
EXTRAS = {"timings", "cost"}


def no_unlisted_fields(value: dict[str, Any], component: str) -> None:
    """Top-level fields beyond the spec's `component` are only the listed `EXTRAS`."""
    extra = set(value) - set(_spec().schemas[component]["properties"])
    assert extra <= EXTRAS, (component, extra)


def _cited(value: dict[str, Any]) -> dict[str, Any]:
    """A copy of `value` with `citations: null` on each text block that leaves it out.

    The one conflict between the spec and the API here: the spec marks a text block's
    `citations` required, the API leaves it out when nothing is cited, and the Vercel AI
    SDK refuses a null there (tests/clients/test_vercel_ai.py). tokenyard follows the
    API; every other field is checked as sent."""
    def fix(block: Any) -> Any:
        if isinstance(block, dict) and block.get("type") == "text":
            assert "citations" not in block, block  # left out, as the API does
            return {**block, "citations": None}
        return block

    out = dict(value)
    if isinstance(out.get("content"), list):
        out["content"] = [fix(b) for b in out["content"]]
    if isinstance(out.get("content_block"), dict):
        out["content_block"] = fix(out["content_block"])
    return out


def valid_message(value: dict[str, Any], what: str) -> dict[str, Any]:
    _spec().validate(_cited(value), "Message", what)
    no_unlisted_fields(value, "Message")
    assert set(value["usage"]) == set(_spec().schemas["Usage"]["properties"]), value
    return value


def valid_error(response: httpx.Response, status: int, what: str) -> dict[str, Any]:
    assert response.status_code == status, (what, response.status_code, response.text)
    error = response.json()
    _spec().validate(error, _spec().response_schema("/v1/messages", "4XX"), what)
    assert error["request_id"] == response.headers.get("request-id", error["request_id"])
    return dict(error["error"])


def _event_components() -> dict[str, str]:
    """Each stream event's `type` → its component in the spec's `MessageStreamEvent`."""
    mapping = _spec().schemas["MessageStreamEvent"]["discriminator"]["mapping"]
    return {kind: ref.rsplit("/", 1)[-1] for kind, ref in mapping.items()}


def validate_event(event: dict[str, Any]) -> None:
    """One stream event against the spec (see the module's docstring for ping and error)."""
    kind = event["type"]
    if kind == "ping":
        assert event == {"type": "ping"}, event
    elif kind == "error":
        _spec().validate(event, "ErrorResponse", "error event")
    else:
        components = _event_components()
        assert kind in components, f"no schema for {kind}"
        _spec().validate(_cited(event), components[kind], kind)
        no_unlisted_fields(event, components[kind])


def stream(server: Server, fields: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed request, each validated, the SSE event name checked
    against its `type`."""
    events = []
    with httpx.stream("POST", server.base_url + "/v1/messages", timeout=120,
                      json=body(server, stream=True) | fields,
                      headers=headers(server.api_key)) as r:
        assert r.status_code == 200, r.read()
        for name, event in sse_events(r.iter_lines()):
            assert event["type"] == name, (name, event)
            validate_event(event)
            events.append(event)
    return events


CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "system": {"system": "Answer in French."},
    "system_blocks": {"system": [{"type": "text", "text": "Answer in French."}]},
    "multi_turn": {"messages": [{"role": "user", "content": "Hi."},
                                {"role": "assistant", "content": "Hello!"},
                                {"role": "user", "content": [{"type": "text",
                                                              "text": "Say hi again."}]}]},
    "prefill": {"messages": [{"role": "user", "content": "Name a colour."},
                             {"role": "assistant", "content": "The colour is"}]},
    "tools_auto": {"tools": [WEATHER], "tool_choice": {"type": "auto"}},
    "tools_any": {"tools": [WEATHER], "tool_choice": {"type": "any"}, "max_tokens": 32},
    "tools_named": {"tools": [WEATHER], "max_tokens": 32,
                    "tool_choice": {"type": "tool", "name": "get_weather"}},
    "stop_sequences": {"stop_sequences": ["zzz-never"]},
}


@pytest.mark.parametrize("case", CASES)
def test_a_message_validates_against_the_spec(server: Server, case: str) -> None:
    r = post(server, body(server, **CASES[case]))
    assert r.status_code == 200, r.text
    message = valid_message(r.json(), case)
    if message["stop_reason"] == "tool_use":
        assert [b["type"] for b in message["content"]][-1] == "tool_use", message


@pytest.mark.parametrize("case", ["plain", "tools_named"])
def test_every_stream_event_validates_against_its_schema(server: Server, case: str) -> None:
    events = stream(server, CASES[case])
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert "message_delta" in kinds and "ping" in kinds, kinds
    if case == "tools_named":
        assert "input_json_delta" in {e.get("delta", {}).get("type") for e in events}


def test_stop_sequence_reports_which_one_matched(server: Server) -> None:
    """The model is told to repeat a word; the one of two stop sequences it meets is the
    `stop_sequence` reported, streamed or not."""
    fields = {"max_tokens": 8, "stop_sequences": ["zzz-never", " "],
              "messages": [{"role": "user", "content": "Say: hello world hello world"}]}
    message = valid_message(post(server, body(server, **fields)).json(), "stop")
    assert message["stop_reason"] == "stop_sequence", message
    assert message["stop_sequence"] == " ", message
    delta = next(e for e in stream(server, fields) if e["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] == "stop_sequence", delta
    assert delta["delta"]["stop_sequence"] == " ", delta


def test_count_tokens_validates(server: Server) -> None:
    fields = body(server, tools=[WEATHER], system="Be brief.")
    del fields["max_tokens"], fields["temperature"]
    r = post(server, fields,
             path="/v1/messages/count_tokens")
    assert r.status_code == 200, r.text
    _spec().validate(r.json(), _spec().response_schema("/v1/messages/count_tokens", 200),
                     "count_tokens")
    assert r.json()["input_tokens"] > 0



@pytest.mark.parametrize("fields", [
    {"max_tokens": 0}, {"messages": []}, {"temperature": 3}, {"no_such_field": 1},
    {"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]},
])
def test_a_bad_request_is_a_400_in_anthropic_s_shape(server: Server,
                                                     fields: dict[str, Any]) -> None:
    error = valid_error(post(server, body(server, **fields)), 400, str(fields))
    assert error["type"] == "invalid_request_error"


def test_a_bad_stream_request_is_a_400_before_any_event(server: Server) -> None:
    r = post(server, body(server, stream=True, max_tokens=0))
    assert valid_error(r, 400, "stream")["type"] == "invalid_request_error"


def test_401_403_404_and_429_are_in_anthropic_s_shape(server: Server) -> None:
    assert valid_error(post(server, body(server), key="sk-not-a-key"), 401,
                       "401")["type"] == "authentication_error"
    scoped = new_key(server, models=["some-other-model"])
    assert valid_error(post(server, body(server), key=scoped), 403,
                       "403")["type"] == "permission_error"
    assert valid_error(post(server, body(server, model="no-such-model")), 404,
                       "404")["type"] == "not_found_error"
    limited = new_key(server, rpm=1)
    assert post(server, body(server), key=limited).status_code == 200
    assert valid_error(post(server, body(server), key=limited), 429,
                       "429")["type"] == "rate_limit_error"
    count = {k: v for k, v in body(server).items() if k not in ("max_tokens", "temperature")}
    assert valid_error(post(server, count, path="/v1/messages/count_tokens",
                            key="sk-not-a-key"), 401, "count 401")
