"""`tokenyard serve --lora-modules a0=…,a1=…`: each adapter is the model `MODEL:NAME`
(listed by /v1/models with its `parent`), served through the official OpenAI SDK; the
base model and two adapters at once each answer as they do alone, the adapters
differently from the base; an adapter the server does not serve is the API's 404; a key
scoped to one adapter reaches only it, and its usage is priced and reported under the
adapter's name; an adapter registered through the admin API serves until it is deleted."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import Server, replica_get, running_server
from tests.e2e.test_admin_http import call
from tokenyard.bench.lora_adapters import write_adapters

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


async def _ask(client: openai.AsyncOpenAI, model: str) -> str:
    reply = await client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=16)  # type: ignore[arg-type]
    return reply.choices[0].message.content or ""


def test_adapters_served_by_model_name(tmp_path: Path) -> None:
    folders = write_adapters(tmp_path, 3)
    late = folders.pop("a2")  # registered at run time
    modules = ",".join(f"{name}={path}" for name, path in folders.items())
    with running_server("--lora-modules", modules, "--max-loras", "2") as (server, _):
        names = [server.model, f"{server.model}:a0", f"{server.model}:a1"]
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1",
                                    api_key=server.api_key or "none", max_retries=0)

        async def scenario() -> tuple[list[str], list[str]]:
            together = await asyncio.gather(*(_ask(client, name) for name in names))
            alone = [await _ask(client, name) for name in names]
            return list(together), alone

        together, alone = asyncio.run(scenario())
        listed = {m.id: m for m in openai.OpenAI(
            base_url=server.base_url + "/v1", api_key=server.api_key or "none").models.list()}
        with pytest.raises(openai.NotFoundError) as missing:
            openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key or "none",
                          max_retries=0).chat.completions.create(
                model=f"{server.model}:nope", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
        info = replica_get(server, "/v1/engine/info")
        _scoped_and_billed(server, f"{server.model}:a0", f"{server.model}:a1")
        _registered_at_run_time(server, late, base=together[0])
    assert together == alone
    assert together[1] != together[0] and together[2] != together[0]
    assert together[1] != together[2]
    for name in names[1:]:
        assert getattr(listed[name], "parent", None) == server.model
    assert getattr(listed[server.model], "parent", None) is None
    assert missing.value.code == "model_not_found"
    assert info["loras"] == ["a0", "a1"]


def _scoped_and_billed(server: Server, mine: str, other: str) -> None:
    """A key allowed only `mine` (an adapter) is refused the base and `other`; its usage
    is reported under `mine`, at `mine`'s own price."""
    status, org = call(server, "POST", "/admin/v1/orgs", body={"name": "tuned"})
    assert status == 201
    status, key = call(server, "POST", "/admin/v1/keys",
                       body={"org_id": org["id"], "models": [mine]})
    assert status == 201
    status, _ = call(server, "PUT", f"/admin/v1/prices/{mine}",
                     body={"input": "3", "output": "5"})
    assert status == 200
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key["secret"],
                           max_retries=0)
    reply = client.chat.completions.create(model=mine, messages=MESSAGES, max_tokens=3)  # type: ignore[arg-type]
    for refused in (server.model, other):
        with pytest.raises(openai.PermissionDeniedError) as caught:
            client.chat.completions.create(model=refused, messages=MESSAGES, max_tokens=3)  # type: ignore[arg-type]
        assert caught.value.code == "model_not_in_scope"
    assert reply.usage is not None
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while not rows and time.monotonic() < deadline:
        status, body = call(server, "GET", f"/admin/v1/usage?group_by=model&org_id={org['id']}")
        rows = body["data"]
        time.sleep(0.2)
    assert [(r["group"], r["requests"], r["cost_micros"]) for r in rows] == [
        (mine, 1, 3 * reply.usage.prompt_tokens + 5 * reply.usage.completion_tokens)]


def _registered_at_run_time(server: Server, folder: Path, base: str) -> None:
    path = f"/admin/v1/deployments/{server.model}/adapters"
    status, body = call(server, "POST", path, body={"name": "late", "path": str(folder),
                                                     "prices": {"output": "7"}})
    assert status == 201 and body["name"] == f"{server.model}:late", body
    assert body["parent"] == server.model
    answer = asyncio.run(_ask(openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key=server.api_key or "none", max_retries=0),
        f"{server.model}:late"))
    assert answer and answer != base
    # Refused in the API's shape: a folder that is no adapter, an unknown deployment, a
    # field the route does not take.
    status, err = call(server, "POST", path, body={"name": "bad", "path": str(folder.parent)})
    assert status == 400 and err["error"]["param"] == "path", err
    status, err = call(server, "POST", "/admin/v1/deployments/nope/adapters",
                       body={"name": "x", "path": str(folder)})
    assert status == 404 and err["error"]["code"] == "model_not_found", err
    status, err = call(server, "POST", path, body={"name": "x", "path": "/x", "rank": 4})
    assert status == 400 and err["error"]["param"] == "rank", err
    status, _ = call(server, "DELETE", f"{path}/late")
    assert status == 200
    status, err = call(server, "DELETE", f"{path}/late")
    assert status == 404
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key or "none",
                      max_retries=0).chat.completions.create(
            model=f"{server.model}:late", messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
