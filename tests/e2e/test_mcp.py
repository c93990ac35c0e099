"""MCP tools run by the platform (issue 41), through HTTP on the session's server, with
small MCP servers (the `mcp` SDK's) on loopback, registered by the org's admin.

The 3-call agent task forces a call on every turn (`tool_choice: required`, one call a
turn) and caps the calls at 3, so its shape does not hang on what a 135M model decides:
three mcp_call items run by the platform, then the fourth turn answers in text (the loop
lets it only answer once the calls are spent). Each later turn's prompt extends the one
before, so most of its tokens come from the prefix cache.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.e2e.conftest import Server
from tests.e2e.mcp_server import requests_seen, running_mcp_server
from tests.e2e.test_admin_http import call

pytestmark = pytest.mark.slow

TASK = "Compute (2 + 3) * 4, then add 10. Use the tools, one step at a time."


@pytest.fixture(scope="module")
def calc(server: Server) -> Iterator[dict[str, Any]]:
    """A calculator MCP server that wants a secret header, registered for the dev key's
    org with that header: {"label", "url", "secret", "org_id", "id"}."""
    secret = f"s3cret-{uuid.uuid4().hex}"
    with running_mcp_server(secret) as url:
        status, orgs = call(server, "GET", "/admin/v1/orgs")
        assert status == 200
        org_id = next(o["id"] for o in orgs["data"] if o["name"] == "default")
        label = f"calc-{uuid.uuid4().hex[:6]}"
        status, made = call(server, "POST", f"/admin/v1/orgs/{org_id}/mcp_servers", body={
            "label": label, "url": url, "headers": {"X-Api-Secret": secret},
            "allowed_tools": ["add", "multiply", "record", "last_calls"]})
        assert status == 201, made
        assert made["headers"] == ["X-Api-Secret"] and secret not in json.dumps(made)
        yield {"label": label, "url": url, "secret": secret, "org_id": org_id,
               "id": made["id"]}
        status, _ = call(server, "DELETE", f"/admin/v1/mcp_servers/{made['id']}")
        assert status == 200


def client(server: Server, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key or server.api_key,
                         max_retries=0, timeout=600)


def mcp_tool(calc: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": calc["label"], "require_approval": "never",
            "allowed_tools": ["add", "multiply"]} | fields


def agent_task(calc: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return dict(input=TASK, tools=[mcp_tool(calc)], tool_choice="required",
                max_tool_calls=3, parallel_tool_calls=False, max_output_tokens=40,
                temperature=0) | fields


def test_a_three_call_agent_task_runs_on_the_platform(server: Server,
                                                      calc: dict[str, Any]) -> None:
    raw = client(server).responses.with_raw_response.create(
        model=server.model, **agent_task(calc))
    response = raw.parse()
    kinds = [item.type for item in response.output]
    assert kinds[0] == "mcp_list_tools", kinds
    listed = response.output[0]
    assert {t.name for t in listed.tools} == {"add", "multiply"}  # allowed_tools
    calls = [item for item in response.output if item.type == "mcp_call"]
    assert len(calls) == 3, kinds
    for item in calls:
        assert item.server_label == calc["label"] and item.status == "completed"
        assert item.error is None and item.output is not None
        arguments = json.loads(item.arguments)
        assert item.output == str(arguments["a"] + arguments["b"] if item.name == "add"
                                  else arguments["a"] * arguments["b"])
    assert kinds[-1] == "message"  # the turn after the last call answers in text
    # Four turns, each billed; every later turn's prompt extends the one before.
    usage = response.usage
    assert usage is not None and usage.input_tokens_details.cached_tokens > 0
    timings = response.model_extra["timings"]  # a stage per hop
    assert {"mcp_list", "hop1", "mcp_call1", "hop2", "hop3", "hop4"} <= set(timings)
    record = _record(server, raw.headers["x-request-id"])
    assert record["tokens"]["prompt"] == usage.input_tokens  # one record: the turns' sums
    assert record["tokens"]["cached"] == usage.input_tokens_details.cached_tokens
    later = usage.input_tokens - _first_prompt(server, calc)
    assert usage.input_tokens_details.cached_tokens >= 0.8 * later


def _first_prompt(server: Server, calc: dict[str, Any]) -> int:
    """The prompt tokens of the task's first turn alone: the same request, its call
    waiting for approval, ends after that turn."""
    response = client(server).responses.create(model=server.model, **agent_task(
        calc, tools=[mcp_tool(calc, require_approval="always")]))
    assert [i.type for i in response.output][-1] == "mcp_approval_request"
    assert response.usage is not None
    return response.usage.input_tokens


def _record(server: Server, request_id: str) -> dict[str, Any]:
    status, record = call(server, "GET", f"/v1/requests/{request_id}")
    assert status == 200, record
    return dict(record)


def test_an_unregistered_loopback_server_url_is_refused(server: Server) -> None:
    with running_mcp_server() as url, pytest.raises(openai.BadRequestError) as refused:
        client(server).responses.create(
            model=server.model, input="Hi", max_output_tokens=4,
            tools=[{"type": "mcp", "server_label": "mine", "server_url": url}])
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "tools.0"
    assert "not a public address" in error["message"]


def test_a_call_that_needs_approval_waits_for_it_then_runs(server: Server,
                                                           calc: dict[str, Any]) -> None:
    openai_client = client(server)
    tool = mcp_tool(calc, require_approval={"always": {"tool_names": ["add"]}},
                    allowed_tools=["add"])
    first = openai_client.responses.create(
        model=server.model, input="Add 20 and 22.", tools=[tool], tool_choice="required",
        max_output_tokens=40, temperature=0)
    asked = [i for i in first.output if i.type == "mcp_approval_request"]
    assert len(asked) == 1 and asked[0].name == "add", first.output
    assert not [i for i in first.output if i.type == "mcp_call"]
    arguments = json.loads(asked[0].arguments)

    second = openai_client.responses.create(
        model=server.model, previous_response_id=first.id, tools=[tool],
        max_output_tokens=24, temperature=0,
        input=[{"type": "mcp_approval_response", "approve": True,
                "approval_request_id": asked[0].id}])
    ran = second.output[0]
    assert ran.type == "mcp_call" and ran.approval_request_id == asked[0].id
    assert ran.output == str(arguments["a"] + arguments["b"])
    # Listed once, in the first response: the second reads the list back.
    assert not [i for i in second.output if i.type == "mcp_list_tools"]


def test_secrets_stay_out_of_records_and_logs(server: Server, calc: dict[str, Any]) -> None:
    request_secret = f"req-secret-{uuid.uuid4().hex}"
    status, _ = call(server, "POST", f"/admin/v1/orgs/{calc['org_id']}/capture", body={})
    assert status == 200
    try:
        raw = client(server).responses.with_raw_response.create(
            model=server.model, **agent_task(calc, max_tool_calls=1, tools=[mcp_tool(
                calc, server_url=calc["url"], headers={"X-Other": request_secret},
                authorization=request_secret)]))
    finally:
        call(server, "POST", f"/admin/v1/orgs/{calc['org_id']}/capture",
             body={"enabled": False})
    response = raw.parse()
    assert [i.type for i in response.output].count("mcp_call") == 1  # the secret got there
    record = _record(server, raw.headers["x-request-id"])
    captured = json.dumps(record)
    assert record["capture"] is not None and "mcp_call" in captured
    for secret in (request_secret, calc["secret"]):
        assert secret not in captured
        assert secret not in json.dumps(response.model_dump(mode="json"))
        assert not [line for line in server.output if secret in line]
    status, listing = call(server, "GET", f"/admin/v1/orgs/{calc['org_id']}/mcp_servers")
    assert status == 200 and calc["secret"] not in json.dumps(listing)


def test_a_key_without_a_grant_may_not_call_a_granted_server(server: Server,
                                                            calc: dict[str, Any]) -> None:
    status, key = call(server, "POST", "/admin/v1/keys", body={"org_id": calc["org_id"]})
    assert status == 201
    granted_server = {**calc, "label": f"grant-{uuid.uuid4().hex[:6]}"}
    status, made = call(server, "POST", f"/admin/v1/orgs/{calc['org_id']}/mcp_servers",
                        body={"label": granted_server["label"], "url": calc["url"],
                              "headers": {"X-Api-Secret": calc["secret"]}})
    assert status == 201, made
    try:
        status, granted = call(server, "POST", f"/admin/v1/mcp_servers/{made['id']}/grants",
                               body={"key_id": key["id"], "tools": ["add"]})
        assert status == 200 and granted["tools"] == ["add"]
        with pytest.raises(openai.PermissionDeniedError):  # the dev key has no grant
            client(server).responses.create(model=server.model,
                                            **agent_task(granted_server))
        response = client(server, key["secret"]).responses.create(
            model=server.model, **agent_task(granted_server, max_tool_calls=1))
        assert {t.name for t in response.output[0].tools} == {"add"}  # the grant's tools
        status, body = call(server, "POST", f"/admin/v1/mcp_servers/{made['id']}/grants",
                            body={"key_id": key["id"], "bogus": 1})
        assert status == 400 and body["error"]["param"] == "bogus"
    finally:
        status, _ = call(server, "DELETE", f"/admin/v1/mcp_servers/{made['id']}")
        assert status == 200


def test_anthropic_mcp_servers_run_on_the_platform(server: Server,
                                                   calc: dict[str, Any]) -> None:
    anthropic_client = anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key,
                                           max_retries=0, timeout=600)
    message = anthropic_client.beta.messages.create(
        model=server.model, max_tokens=40, extra_body={"temperature": 0},
        betas=["mcp-client-2025-04-04"],
        messages=[{"role": "user", "content": "Add 20 and 22 with the add tool."}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        mcp_servers=[{"type": "url", "url": calc["url"], "name": calc["label"],
                      "tool_configuration": {"allowed_tools": ["add"]}}])
    kinds = [block.type for block in message.content]
    assert kinds[:2] == ["mcp_tool_use", "mcp_tool_result"], kinds
    use, result = message.content[0], message.content[1]
    assert use.server_name == calc["label"] and use.name == "add"
    assert result.tool_use_id == use.id and not result.is_error
    assert result.content[0].text == str(use.input["a"] + use.input["b"])
    assert kinds[-1] == "text"
    # Each model turn's usage; a later turn's prompt is mostly the cached earlier one.
    turns = message.usage.iterations
    assert turns is not None and len(turns) == kinds.count("mcp_tool_use") + 1
    for turn in turns[1:]:
        prompt = turn.input_tokens + turn.cache_read_input_tokens
        assert turn.cache_read_input_tokens >= 0.8 * prompt, turns
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == sum(
        t.input_tokens + t.cache_read_input_tokens for t in turns)


# ---------------------------------------------------------------------------- conformance
#
# Neither OpenAI's document in ../shared/specs (2.3.0) nor Open Responses' defines the
# MCP items and events: every event whose type the Open Responses stream schema names is
# validated there (an item event's MCP item taken out of it first), and every MCP item
# and event, and the whole response, against the installed `openai` SDK's models, which
# OpenAI generates from its current API description. Anthropic's document defines its
# MCP blocks (beta): those bodies and events validate against it as sent.

_OPENAI_MCP_ITEMS = {"mcp_list_tools", "mcp_call", "mcp_approval_request"}


def _sdk_checked(event: dict[str, Any]) -> dict[str, Any]:
    """`event` with its MCP parts checked against the SDK's models and taken out: an MCP
    event whole, an MCP item of an item event, the MCP items and tools of a response."""
    from openai.types.responses import ResponseOutputItem, ResponseStreamEvent, Tool
    from pydantic import TypeAdapter

    if event["type"].startswith(("response.mcp_call", "response.mcp_list_tools")):
        parsed = TypeAdapter(ResponseStreamEvent).validate_python(event)
        assert parsed.type == event["type"], (type(parsed).__name__, event)
        return {}
    items = TypeAdapter(ResponseOutputItem)
    item = event.get("item")
    if isinstance(item, dict) and item["type"] in _OPENAI_MCP_ITEMS:
        assert items.validate_python(item).type == item["type"]
        return event | {"item": None}  # the spec's item union lacks MCP items
    response = event.get("response")
    if isinstance(response, dict):
        for entry in response["output"]:
            if entry["type"] in _OPENAI_MCP_ITEMS:
                assert items.validate_python(entry).type == entry["type"]
        for tool in response["tools"]:
            if tool["type"] == "mcp":
                assert TypeAdapter(Tool).validate_python(tool).type == "mcp"
        return event | {"response": response | {
            "output": [i for i in response["output"] if i["type"] not in _OPENAI_MCP_ITEMS],
            "tools": [t for t in response["tools"] if t["type"] != "mcp"]}}
    return event


def test_every_mcp_stream_event_validates(server: Server, calc: dict[str, Any]) -> None:
    from tests.conformance.test_responses import _event_components, _open, _resolved

    components = _event_components()
    stream = client(server).responses.create(
        model=server.model, stream=True, **agent_task(calc, max_tool_calls=2))
    events = [event.model_dump(mode="json", exclude_unset=True) for event in stream]
    for event in events:
        kind = event["type"]
        rest = _sdk_checked(event)
        if rest:
            assert kind in components, f"no schema for {kind}"
            _open().validate(_resolved(rest, kind), components[kind], kind)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    for expected in ("response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed",
                     "response.mcp_call_arguments.delta", "response.mcp_call_arguments.done",
                     "response.mcp_call.in_progress", "response.mcp_call.completed"):
        assert expected in kinds, (expected, kinds)
    assert kinds.count("response.mcp_call.completed") == 2
    assert kinds[-1] == "response.completed" or kinds[-1] == "response.incomplete"
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]].count("mcp_call") == 2


def _anthropic_spec() -> Any:
    from tests.conformance.spec import Spec

    return Spec.load("anthropic")


def _beta_components() -> dict[str, str]:
    mapping = _anthropic_spec().schemas["BetaMessageStreamEvent"]["discriminator"]["mapping"]
    return {kind: ref.rsplit("/", 1)[-1] for kind, ref in mapping.items()}


def test_anthropic_mcp_bodies_and_events_validate(server: Server,
                                                  calc: dict[str, Any]) -> None:
    import httpx

    from tests.conformance.spec import sse_events
    from tests.conformance.test_anthropic import _cited

    body = {"model": server.model, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "Add 20 and 22 with the add tool."}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "mcp_servers": [{"type": "url", "url": calc["url"], "name": calc["label"],
                             "tool_configuration": {"allowed_tools": ["add"]}}]}
    headers = {"x-api-key": server.api_key or "", "anthropic-version": "2023-06-01",
               "anthropic-beta": "mcp-client-2025-04-04"}
    url = server.base_url + "/v1/messages"
    plain = httpx.post(url, json=body, headers=headers, timeout=600)
    assert plain.status_code == 200, plain.text
    spec = _anthropic_spec()
    spec.validate(_cited(plain.json()), "BetaMessage", "body")
    components = _beta_components()
    with httpx.stream("POST", url, json=body | {"stream": True}, headers=headers,
                      timeout=600) as r:
        assert r.status_code == 200
        events = [event for _, event in sse_events(r.iter_lines())]
    for event in events:
        if event["type"] != "ping":
            spec.validate(_cited(event), components[event["type"]], event["type"])
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts[:2] == ["mcp_tool_use", "mcp_tool_result"], starts
    assert [e["type"] for e in events].count("message_stop") == 1


def test_a_key_refused_by_its_limits_or_its_balance_contacts_no_mcp_server(
        server: Server) -> None:
    def org_with_key(name: str, url: str, **limits: Any) -> tuple[str, str]:
        """A new org (`limits`: its own fields) with a key and `url` registered for it as
        "counted": the key's secret and the label."""
        status, org = call(server, "POST", "/admin/v1/orgs", body={"name": name} | limits)
        assert status == 201, org
        status, key = call(server, "POST", "/admin/v1/keys", body={
            "org_id": org["id"], "rpm": 1})
        assert status == 201, key
        status, made = call(server, "POST", f"/admin/v1/orgs/{org['id']}/mcp_servers",
                            body={"label": "counted", "url": url})
        assert status == 201, made
        return key["secret"], "counted"

    def ask(key: str) -> Any:
        return client(server, key).responses.create(
            model=server.model, input="Hi", max_output_tokens=2,
            tools=[{"type": "mcp", "server_label": "counted", "require_approval": "never"}])

    with running_mcp_server() as url:
        key, _ = org_with_key(f"rpm-one-{uuid.uuid4().hex[:6]}", url)
        before = requests_seen(url)
        assert ask(key).output[0].type == "mcp_list_tools"  # admitted: listed
        seen = requests_seen(url)
        assert seen > before
        with pytest.raises(openai.RateLimitError) as over:  # its one request a minute
            ask(key)
        assert over.value.code == "rate_limit_exceeded"
        assert over.value.response.headers["x-ratelimit-remaining-requests"] == "0"

        broke, _ = org_with_key(f"broke-{uuid.uuid4().hex[:6]}", url, balance="0")
        with pytest.raises(openai.RateLimitError) as poor:
            ask(broke)
        assert poor.value.code == "insufficient_quota"
        assert requests_seen(url) == seen  # neither refusal reached the server
