"""The Responses API against the published specs, through HTTP on the session's server.

Every response object (created, retrieved, and the `response` of every lifecycle event)
is validated against Open Responses' `ResponseResource`, every stream event against the
component its `type` names in the spec's `text/event-stream` schema for POST /responses.
Open Responses has no GET/DELETE/input_items routes and no error bodies: those are
validated against OpenAI's document (`ResponseItemList`, `ErrorResponse`). Requests ask
for a handful of tokens, so the file stays quick.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

import httpx
import pytest

from tests.conformance.keys import new_key
from tests.conformance.spec import Spec, sse_events
from tests.e2e.conftest import Server

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}


def _open() -> Spec:
    return Spec.load("openresponses")


def _openai() -> Spec:
    return Spec.load("openai")


def _event_components() -> dict[str, str]:
    """Each stream event's `type` → its component in the spec's stream schema."""
    spec = _open()
    stream = spec.operation("/responses")["responses"]["200"]["content"]["text/event-stream"]
    out = {}
    for ref in stream["schema"]["oneOf"]:
        name = ref["$ref"].rsplit("/", 1)[-1]
        for kind in spec.schemas[name]["properties"]["type"].get("enum", ()):
            out[kind] = name
    return out


def post(server: Server, body: dict[str, Any], key: str | None = None,
         path: str = "/v1/responses") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else server.headers
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=120)


def request(server: Server, method: str, path: str) -> httpx.Response:
    return httpx.request(method, server.base_url + path, headers=server.headers, timeout=60)


def body(server: Server, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "input": "Say hi.", "max_output_tokens": 4,
            "temperature": 0.0} | fields


def _resolved(value: dict[str, Any], what: str) -> dict[str, Any]:
    """`value` (a response, or an event carrying one) ready for Open Responses' schemas.
    One conflict between the documents: its `JsonSchemaResponseFormat.schema` allows
    only null (its generator lost the type), where OpenAI's `TextResponseFormatJsonSchema`
    and SDK require the echoed JSON schema object. That field is checked to be the
    object, then nulled in the copy validated."""
    checked = copy.deepcopy(value)
    text = checked.get("response", checked).get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        assert isinstance(fmt.get("schema"), dict), (what, fmt)
        fmt["schema"] = None
    return checked


def valid_response(value: dict[str, Any], what: str) -> dict[str, Any]:
    _open().validate(_resolved(value, what), "ResponseResource", what)
    return value


def valid_error(response: httpx.Response, status: int, what: str) -> dict[str, Any]:
    assert response.status_code == status, (what, response.status_code, response.text)
    error = response.json()
    _openai().validate(error, "ErrorResponse", what)
    return dict(error["error"])


def stream(server: Server, fields: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed request, each validated against its component, the SSE
    event name checked against its `type`, and the sequence numbers counted from 0."""
    components = _event_components()
    events = []
    with httpx.stream("POST", server.base_url + "/v1/responses", timeout=120,
                      json=body(server, stream=True) | fields, headers=server.headers) as r:
        assert r.status_code == 200, r.read()
        for name, event in sse_events(r.iter_lines()):
            assert event["type"] == name, (name, event)
            assert event["type"] in components, f"no schema for {event['type']}"
            _open().validate(_resolved(event, event["type"]), components[event["type"]],
                             event["type"])
            events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "instructions": {"instructions": "Answer in French.",
                     "input": [{"role": "user",
                                "content": [{"type": "input_text", "text": "Hello"}]}]},
    "tools_auto": {"tools": [WEATHER], "tool_choice": "auto"},
    "tools_required": {"tools": [WEATHER], "tool_choice": "required", "max_tool_calls": 1,
                       "max_output_tokens": 48},
    "tools_named": {"tools": [WEATHER], "max_output_tokens": 48,
                    "tool_choice": {"type": "function", "name": "get_weather"}},
    "json_schema": {"text": {"format": {"type": "json_schema", "name": "city",
                                        "schema": CITY, "strict": True}},
                    "max_output_tokens": 16},
    "truncation_auto": {"truncation": "auto"},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.25},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_response_validates_against_response_resource(server: Server, case: str) -> None:
    fields = CASES[case]
    r = post(server, body(server, **fields))
    assert r.status_code == 200, r.text
    value = valid_response(r.json(), case)
    assert value["presence_penalty"] == fields.get("presence_penalty", 0.0)
    assert value["max_tool_calls"] == fields.get("max_tool_calls")
    forced = fields.get("tool_choice") in ("required", {"type": "function",
                                                         "name": "get_weather"})
    if forced and value["status"] == "completed":  # a call cut short is text
        calls = [i for i in value["output"] if i["type"] == "function_call"]
        assert calls and all(c["name"] == "get_weather" for c in calls), value["output"]
        if "max_tool_calls" in fields:
            assert len(calls) <= fields["max_tool_calls"], value["output"]


@pytest.mark.parametrize("case", ["plain", "tools_named", "json_schema"])
def test_every_stream_event_validates_against_its_schema(server: Server, case: str) -> None:
    events = stream(server, CASES[case])
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    valid_response(events[-1]["response"], kinds[-1])


def test_stored_responses_retrieve_chain_list_and_delete_per_spec(server: Server) -> None:
    first = post(server, body(server, input="My name is Ada."))
    assert first.status_code == 200, first.text
    first_id = valid_response(first.json(), "first")["id"]
    second = post(server, body(server, input="What is my name?",
                               previous_response_id=first_id))
    assert second.status_code == 200, second.text
    second_id = valid_response(second.json(), "second")["previous_response_id"]
    assert second_id == first_id

    got = request(server, "GET", f"/v1/responses/{first_id}")
    assert got.status_code == 200, got.text
    assert valid_response(got.json(), "retrieved")["output"] == first.json()["output"]

    items = request(server, "GET", f"/v1/responses/{first_id}/input_items")
    assert items.status_code == 200, items.text
    _openai().validate(items.json(), "ResponseItemList", "input_items")

    deleted = request(server, "DELETE", f"/v1/responses/{first_id}")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"id": first_id, "object": "response.deleted", "deleted": True}
    for method, path in [("GET", f"/v1/responses/{first_id}"),
                         ("DELETE", f"/v1/responses/{first_id}"),
                         ("GET", f"/v1/responses/{first_id}/input_items")]:
        error = valid_error(request(server, method, path), 404, f"{method} {path}")
        assert error["code"] == "not_found"


def test_compact_answers_the_spec_s_compacted_response(server: Server) -> None:
    turns = [{"role": "user", "content": "Hi, I am Ada."},
             {"role": "assistant", "content": "Hello Ada."}, {"role": "user", "content": "Bye"}]
    # The summary is a model turn of up to 128 tokens: slow on a loaded CPU.
    r = httpx.post(server.base_url + "/v1/responses/compact", headers=server.headers,
                   json={"model": server.model, "input": turns}, timeout=600)
    assert r.status_code == 200, r.text
    spec = _open()
    spec.validate(r.json(), spec.response_schema("/responses/compact", 200), "compact")
    assert [i["type"] for i in r.json()["output"]] == ["compaction", "message"]
    bad = post(server, {"model": server.model}, path="/v1/responses/compact")
    assert valid_error(bad, 400, "compact without input")["param"] == "input"


@pytest.mark.parametrize(("fields", "param"), [
    ({"bogus_field": 1}, "bogus_field"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"background": True, "store": False}, "store"),
    ({"max_tool_calls": 0}, "max_tool_calls"),
    ({"previous_response_id": "resp_nothere"}, "previous_response_id"),
])
def test_a_bad_request_is_a_400_naming_the_field(server: Server, fields: dict[str, Any],
                                                 param: str) -> None:
    error = valid_error(post(server, body(server, **fields)), 400, str(fields))
    assert error["param"] == param


def test_a_bad_stream_request_is_a_400_before_any_event(server: Server) -> None:
    r = post(server, body(server, stream=True, previous_response_id="resp_nothere"))
    assert valid_error(r, 400, "stream")["param"] == "previous_response_id"



def test_401_403_and_429_are_in_the_api_s_error_shape(server: Server) -> None:
    valid_error(post(server, body(server), key="sk-not-a-key"), 401, "401")
    scoped = new_key(server, models=["some-other-model"])
    valid_error(post(server, body(server), key=scoped), 403, "403")
    limited = new_key(server, rpm=1)
    assert post(server, body(server), key=limited).status_code == 200
    valid_error(post(server, body(server), key=limited), 429, "429")


def test_unknown_response_id_is_a_404(server: Server) -> None:
    missing = f"resp_{uuid.uuid4().hex}"
    error = valid_error(request(server, "GET", f"/v1/responses/{missing}"), 404, "404")
    assert missing in error["message"]
