"""The MCP registry (gateway/mcp_registry.py) on a SQLite store, its outbound client's
address rules (api/mcp_client.py) and a request's toolbox (gateway/mcp_toolbox.py),
against a real MCP server on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.e2e.mcp_server import running_mcp_server
from tokenyard.api.mcp_answer import REDACTED, scrubbed
from tokenyard.api.mcp_client import McpClient
from tokenyard.errors import APIError
from tokenyard.gateway import mcp_registry as registry
from tokenyard.gateway.admin import AdminError, NotFound
from tokenyard.gateway.mcp_registry import RequestedServer, resolve
from tokenyard.gateway.mcp_toolbox import Toolbox
from tokenyard.gateway.mcp_tools import McpServer, ServerRefused
from tokenyard.store.db import Database
from tokenyard.store.repo import Store
from tokenyard.telemetry.timeline import Timeline

T = TypeVar("T")


def run(tmp_path: Path, scenario: Callable[[Store], Awaitable[T]]) -> T:
    async def main() -> T:
        db = await Database.open(f"sqlite+aiosqlite:///{tmp_path / 'state.db'}")
        try:
            return await scenario(Store(db))
        finally:
            await db.close()

    return asyncio.run(main())


def test_registered_servers_keep_their_secrets_to_themselves(tmp_path: Path) -> None:
    async def scenario(store: Store) -> None:
        org = await store.create_org("acme")
        project = await store.create_project(org.id, "web")
        made = await registry.register_server(store, org.id, {
            "label": "calc", "url": "http://10.0.0.5/mcp", "headers": {"X-Key": "hush"},
            "allowed_tools": ["add", "multiply"]})
        assert made["headers"] == ["X-Key"] and "hush" not in json.dumps(made)
        listed = await registry.list_servers(store, org.id)
        assert listed == [made] and "hush" not in json.dumps(listed)
        with pytest.raises(AdminError, match="already has"):
            await registry.register_server(store, org.id, {"label": "calc",
                                                           "url": "http://x/mcp"})
        with pytest.raises(NotFound):
            await registry.register_server(store, "org_nope", {"label": "a", "url": "http://x"})
        with pytest.raises(AdminError, match="url"):
            await registry.register_server(store, org.id, {"label": "b", "url": "ftp://x"})

        _, key = await store.create_api_key(org.id, name="k", project_id=project.id)
        _, other = await store.create_api_key(org.id, name="other")
        context = await store.find_key_by_id(key.id)
        outsider = await store.find_key_by_id(other.id)
        assert context is not None and outsider is not None
        wanted = [RequestedServer("calc", None, "tools.0", {"X-Req": "mine"},
                                  frozenset({"add", "record"}))]
        # No grants: every key of the org; the request's headers join the registry's.
        (server,) = await resolve(store, context, wanted)
        assert server.registered and server.url == "http://10.0.0.5/mcp"
        assert dict(server.headers) == {"X-Key": "hush", "X-Req": "mine"}
        assert server.allowed == {"add"}  # the request's within the registry's
        assert "hush" not in repr(server)
        # A grant to the project: its keys only, and its tools only.
        await registry.grant(store, made["id"], {"project_id": project.id,
                                                 "tools": ["add", "multiply"]})
        (server,) = await resolve(store, context, wanted)
        assert server.allowed == {"add"}
        with pytest.raises(APIError) as refused:
            await resolve(store, outsider, wanted)
        assert refused.value.status == 403 and refused.value.param == "tools.0"
        # An unknown label, and a URL no admin registered (reached as a public one).
        with pytest.raises(APIError, match="No MCP server is registered"):
            await resolve(store, context, [RequestedServer("nope", None, "tools.1")])
        (public,) = await resolve(store, context, [RequestedServer(
            "web", "https://example.com/mcp", "tools.0")])
        assert not public.registered
        assert (await registry.remove_server(store, made["id"]))["deleted"] is True
        assert await registry.list_servers(store, org.id) == []

    run(tmp_path, scenario)


def test_an_unregistered_server_must_be_public_and_a_registered_one_may_be_local() -> None:
    async def scenario(url: str) -> tuple[list[str], str]:
        client = McpClient()
        with pytest.raises(ServerRefused, match="not a public address"):
            await client.open(McpServer("calc", url))
        with pytest.raises(ServerRefused, match="http or https"):
            await client.open(McpServer("calc", "file:///etc/passwd", registered=True))
        box = await Toolbox.open(client, [McpServer("calc", url, registered=True,
                                                    allowed=frozenset({"add", "record"}),
                                                    read_only=True)],
                                 {"calc": "tools.0"}, {}, Timeline())
        try:
            names = [t.name for t in box.tools]
            outcome = await box.call("add", json.dumps({"a": 2, "b": 40}))
            return names, outcome.text
        finally:
            await box.close()

    with running_mcp_server() as url:
        names, text = asyncio.run(scenario(url))
    assert names == ["add"]  # allowed, and read-only ('record' is not)
    assert text == "42"


def test_a_name_taken_twice_is_refused() -> None:
    async def scenario(url: str) -> None:
        server = McpServer("calc", url, registered=True)
        with pytest.raises(APIError, match="already taken") as refused:
            await Toolbox.open(McpClient(), [server], {"calc": "tools.1"}, {}, Timeline(),
                               taken=["add"])
        assert refused.value.param == "tools.1"

    with running_mcp_server() as url:
        asyncio.run(scenario(url))


def test_a_captured_body_loses_its_mcp_secrets() -> None:
    body: dict[str, Any] = {
        "model": "m", "tools": [{"type": "mcp", "server_label": "a", "headers": {"X": "1"},
                                 "authorization": "tok"}, {"type": "function", "name": "f"}],
        "mcp_servers": [{"type": "url", "url": "u", "name": "n", "authorization_token": "t"}]}
    out = json.loads(scrubbed(json.dumps(body).encode()) or b"")
    assert out["tools"][0]["headers"] == REDACTED and out["tools"][0]["authorization"] == REDACTED
    assert out["mcp_servers"][0]["authorization_token"] == REDACTED
    assert out["tools"][1] == {"type": "function", "name": "f"}


def test_the_cli_registers_lists_grants_and_removes_a_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    from tokenyard.cli.main import main

    monkeypatch.setenv("TOKENYARD_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENYARD_DATABASE_URL", raising=False)

    def cli(*args: str, code: int = 0) -> Any:
        assert main(["admin", "--format", "json", *args]) == code
        out = capsys.readouterr()
        return json.loads(out.out) if code == 0 else out.err

    org = cli("orgs", "create", "acme")["id"]
    made = cli("mcp", "add", "--org", org, "--label", "calc", "--url",
               "http://10.0.0.5:8000/mcp", "--header", "Authorization: Bearer hush",
               "--allowed-tool", "add", "--require-approval", "never")
    assert made["headers"] == ["Authorization"] and made["allowed_tools"] == ["add"]
    assert "'NAME: VALUE'" in cli("mcp", "add", "--org", org, "--label", "x", "--url",
                                  "http://x/mcp", "--header", "nocolon", code=2)
    key = cli("keys", "create", "--org", org)["id"]
    grant = cli("mcp", "grant", made["id"], "--key", key, "--tool", "add")
    assert grant == {"server_id": made["id"], "subject": "key", "subject_id": key,
                     "tools": ["add"]}
    (listed,) = cli("mcp", "list", "--org", org)
    assert listed["grants"] == [{"subject": "key", "subject_id": key, "tools": ["add"]}]
    assert "hush" not in json.dumps(listed)
    assert cli("mcp", "remove", made["id"])["deleted"] is True
    assert cli("mcp", "list") == []
