"""`/admin/v1` on a running `tokenyard serve`: an admin key makes an org and a key; the new
key works through the OpenAI SDK, may not administer, and its usage shows in the report.
Every boolean the admin API takes is a JSON boolean or a 400, never a truthy stand-in."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.e2e.conftest import Server, running_server

SRC = Path(__file__).resolve().parents[2] / "src" / "tokenyard"


async def _call(server: Server, method: str, path: str, key: str | None = None,
                body: dict[str, Any] | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key or server.api_key}"}
    async with aiohttp.ClientSession(headers=headers) as session, session.request(
        method, server.base_url + path, json=body
    ) as r:
        if r.content_type == "application/json":
            return r.status, await r.json()
        return r.status, await r.text()


def call(server: Server, method: str, path: str, key: str | None = None,
         body: dict[str, Any] | None = None) -> tuple[int, Any]:
    return asyncio.run(_call(server, method, path, key, body))


@pytest.fixture
def fresh_server() -> Iterator[Server]:
    """A `tokenyard serve` of its own, which no other test has sent a request to: the
    figures below then owe nothing to the order of the tests (on the session's server the
    test used to pass only when it ran first, before any request had read the prices)."""
    with running_server() as (srv, _):
        yield srv


@pytest.mark.slow  # loads the model (the e2e conftest marks only users of `server`)
def test_an_admin_key_creates_an_org_and_a_key_that_serves_and_is_billed(
    fresh_server: Server,
) -> None:
    server = fresh_server
    status, org = call(server, "POST", "/admin/v1/orgs", body={"name": "acme", "rpm": 100})
    assert status == 201 and org["rpm"] == 100
    status, project = call(server, "POST", f"/admin/v1/orgs/{org['id']}/projects",
                           body={"name": "web"})
    assert status == 201
    status, key = call(server, "POST", "/admin/v1/keys", body={
        "org_id": org["id"], "project_id": project["id"], "name": "app"})
    assert status == 201 and key["secret"].startswith("sk-ty-")
    # A first request reads the (empty) price list; the price set next applies anyway, from
    # the gateway's next request on.
    admin = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                          max_retries=0)
    admin.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hello"}], max_tokens=1)
    status, _ = call(server, "PUT", f"/admin/v1/prices/{server.model}",
                     body={"input": "1", "output": "2"})
    assert status == 200

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key["secret"],
                           max_retries=0)
    reply = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert reply.usage is not None

    # The new key is not an admin.
    status, err = call(server, "GET", "/admin/v1/orgs", key=key["secret"])
    assert status == 403 and "admin" in err["error"]["message"]

    # The ledger row lands off the request path; the report sums it.
    deadline, rows = time.monotonic() + 10, []
    while time.monotonic() < deadline:
        status, body = call(server, "GET", f"/admin/v1/usage?group_by=project&org_id={org['id']}")
        rows = body["data"]
        if rows:
            break
        time.sleep(0.2)
    assert rows == [{
        "group": project["id"], "requests": 1,
        "prompt_tokens": reply.usage.prompt_tokens, "cached_tokens": 0,
        "output_tokens": reply.usage.completion_tokens,
        # $1 per million input tokens, $2 per million output tokens, in micro-units.
        "cost_micros": reply.usage.prompt_tokens + 2 * reply.usage.completion_tokens,
        "cost": rows[0]["cost"],
    }]
    status, csv_text = call(server, "GET", "/admin/v1/usage?group_by=model&format=csv")
    assert status == 200 and csv_text.startswith("group,requests,")

    status, _ = call(server, "POST", f"/admin/v1/keys/{key['id']}/revoke")
    assert status == 200
    time.sleep(1.1)  # key lookups are cached for at most 1 s
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_admin_arguments_are_validated_in_the_openai_error_shape(server: Server) -> None:
    status, err = call(server, "POST", "/admin/v1/orgs", body={"name": "x", "rpm": "many"})
    assert status == 400 and err["error"]["param"] == "rpm"
    status, err = call(server, "POST", "/admin/v1/keys", body={"org_id": "org_nope"})
    assert status == 404 and err["error"]["param"] == "org_id"
    status, err = call(server, "GET", "/admin/v1/orgs", key="sk-ty-wrong")
    assert status == 401 and err["error"]["code"] == "invalid_api_key"


#: Stand-ins for a boolean that are not one: `bool()` of each but 0 and null is True.
NOT_BOOLEANS: list[Any] = ["false", "true", 0, 1, "yes", None]
#: Every boolean field of the admin API, with the value it takes when left out. A null
#: counts as left out where that is false; where it is true, a null is refused too.
BOOLEAN_FIELDS = {"admin": False, "enabled": True, "drain": True}


def test_the_walk_below_covers_every_boolean_the_admin_api_reads() -> None:
    """The admin API reads a boolean through `gateway.admin.flag` (which refuses anything
    but true and false), never through bool(): a new boolean field must join the walk."""
    read = set()
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        read |= set(re.findall(r"\bflag\(\s*\w+,\s*\"(\w+)\"", text))
        if "admin" in path.stem:
            assert not re.search(r"\bbool\((args|body)\b", text), path
    assert read == set(BOOLEAN_FIELDS)


def test_every_admin_boolean_refuses_what_is_not_a_json_boolean(server: Server) -> None:
    """`"admin": "false"` once made an admin key (bool("false") is True). Each boolean field
    of the admin API, sent each stand-in, answers 400 naming the field and stores nothing
    true; a null where the field is optional and false when left out is taken as left out."""
    status, org = call(server, "POST", "/admin/v1/orgs", body={"name": "bools"})
    assert status == 201
    replica = {"deployment": server.model, "replica": server.replica_url}
    requests: dict[str, tuple[str, dict[str, Any]]] = {
        "admin": ("/admin/v1/keys", {"org_id": org["id"]}),
        "enabled": (f"/admin/v1/orgs/{org['id']}/capture", {}),
        "drain": ("/admin/v1/replicas/drain", replica),
    }
    assert set(requests) == set(BOOLEAN_FIELDS)
    try:
        for field, (path, body) in requests.items():
            for value in NOT_BOOLEANS:
                status, answer = call(server, "POST", path, body={**body, field: value})
                if value is None and BOOLEAN_FIELDS[field] is False:
                    assert status < 300, (field, answer)  # left out: false
                    continue
                assert status == 400, (field, value, answer)
                assert answer["error"]["param"] == field, answer
                assert "JSON boolean" in answer["error"]["message"], answer
    finally:
        call(server, "POST", "/admin/v1/replicas/drain", body={**replica, "drain": False})

    status, keys = call(server, "GET", f"/admin/v1/keys?org_id={org['id']}")
    assert status == 200
    assert [k["scopes"]["admin"] for k in keys["data"]] == [False]  # the null's key only
    status, capture = call(server, "GET", f"/admin/v1/orgs/{org['id']}/capture")
    assert status == 200 and capture["capture"] is False
    status, fleet = call(server, "GET", "/admin/v1/deployments")
    assert status == 200
    states = [r["state"] for d in fleet["data"] for r in d["replicas"]
              if r["id"] == server.replica_url]
    assert states and "draining" not in states
    # And the real booleans still work.
    status, key = call(server, "POST", "/admin/v1/keys", body={"org_id": org["id"],
                                                              "admin": False})
    assert status == 201 and key["scopes"]["admin"] is False
    status, capture = call(server, "POST", f"/admin/v1/orgs/{org['id']}/capture",
                           body={"enabled": False})
    assert status == 200 and capture["capture"] is False
