"""The admin API refuses what it does not know: every `/admin/` route of the app's router,
sent a field it does not take, answers 400 naming that field and changes nothing; the
`scopes` object a key is listed with is accepted back and restricts the key; what does
not exist is a 404; a scope refusal carries a `code`."""

from __future__ import annotations

import re
import time
from typing import Any

import openai
import pytest

from tests.e2e.conftest import Server
from tests.e2e.test_admin_http import call
from tokenyard.api.app import make_app
from tokenyard.api.context import AppState
from tokenyard.deployments import FleetSpec
from tokenyard.gateway.routing import Router

BOGUS = "totally_bogus_field"


def admin_routes() -> set[tuple[str, str]]:
    """Every (method, path) under /admin/ that the app's router serves."""
    app = make_app(AppState({}, Router(FleetSpec(deployments={})), 0))
    return {(r.method, r.resource.canonical) for r in app.router.routes()
            if r.resource is not None and r.method != "HEAD"
            and r.resource.canonical.startswith("/admin/")}


def _filled(path: str, ids: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: ids.get(m.group(1), "x"), path)


def test_every_admin_route_refuses_an_unknown_field_and_changes_nothing(
    server: Server,
) -> None:
    status, org = call(server, "POST", "/admin/v1/orgs", body={"name": "bogus-walk"})
    assert status == 201
    status, project = call(server, "POST", f"/admin/v1/orgs/{org['id']}/projects",
                           body={"name": "p"})
    assert status == 201
    status, key = call(server, "POST", "/admin/v1/keys", body={"org_id": org["id"]})
    assert status == 201
    ids = {"org_id": org["id"], "project_id": project["id"], "key_id": key["id"],
           "model": server.model, "name": server.model, "user_id": "user_x"}
    _, before = call(server, "GET", "/admin/v1/orgs")
    _, keys_before = call(server, "GET", "/admin/v1/keys")

    routes = admin_routes()
    # The served process has the same routes, each listed with its schema.
    status, doc = call(server, "GET", "/openapi.json")
    assert status == 200
    listed = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops
              if p.startswith("/admin/")}
    assert routes <= listed
    accepted = []
    for method, path in sorted(routes):
        url = _filled(path, ids)
        if method == "GET":
            status, answer = call(server, method, f"{url}?{BOGUS}=1")
        else:  # a body that is otherwise fine where one is easy to give
            body = {"/admin/v1/orgs": {"name": "n"},
                    "/admin/v1/keys": {"org_id": org["id"]}}.get(path, {})
            status, answer = call(server, method, url, body={**body, BOGUS: 1})
        if status != 400 or answer["error"]["param"] != BOGUS \
                or BOGUS not in answer["error"]["message"]:
            accepted.append((method, path, status, answer))
    assert accepted == []
    assert len(routes) >= 30  # the walk saw the routes, not an empty router

    # Nothing was made or changed by the refused calls.
    assert call(server, "GET", "/admin/v1/orgs")[1] == before
    assert call(server, "GET", "/admin/v1/keys")[1] == keys_before


def test_the_document_lists_a_schema_for_every_admin_route(server: Server) -> None:
    _, doc = call(server, "GET", "/openapi.json")
    schemas = doc["components"]["schemas"]
    for method, path in admin_routes():
        op = doc["paths"][path][method.lower()]
        if method in ("POST", "PUT"):
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            schema = schemas[ref.rsplit("/", 1)[1]]
            assert schema["additionalProperties"] is False, (method, path)
    create_key = schemas["AdminCreateKey"]["properties"]
    assert {"org_id", "scopes", "models", "admin"} <= set(create_key)


def _refusal_code(server: Server, secret: str, max_tokens: int) -> Any:
    """The `code` of the 403 a chat request with `secret` gets, through the OpenAI SDK."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=secret, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.chat.completions.create(model=server.model, max_tokens=max_tokens,
                                       messages=[{"role": "user", "content": "Hi"}])
    return refused.value.code


def test_a_key_s_listed_scopes_are_accepted_back_and_restrict_it(server: Server) -> None:
    """`"scopes": {"models": [...]}` once made a key for every model."""
    status, org = call(server, "POST", "/admin/v1/orgs", body={"name": "scoped"})
    assert status == 201
    status, key = call(server, "POST", "/admin/v1/keys", body={
        "org_id": org["id"], "scopes": {"models": ["other-model"], "max_context_tokens": 64}})
    assert status == 201, key
    assert key["scopes"] == {"models": ["other-model"], "max_context_tokens": 64,
                             "admin": False}
    assert _refusal_code(server, key["secret"], max_tokens=1) == "model_not_in_scope"

    # The listed key, posted back (with a new org), makes the same scopes.
    _, listed = call(server, "GET", f"/admin/v1/keys?org_id={org['id']}")
    status, copy = call(server, "POST", "/admin/v1/keys", body={
        "org_id": org["id"], "scopes": listed["data"][0]["scopes"]})
    assert status == 201 and copy["scopes"] == key["scopes"]

    # The context scope's refusal has its code too.
    status, wide = call(server, "POST", "/admin/v1/keys", body={
        "org_id": org["id"], "scopes": {"max_context_tokens": 8}})
    assert status == 201
    assert _refusal_code(server, wide["secret"], max_tokens=50) == "context_over_scope"

    # A field given both ways, or one scopes has not got, is refused, naming it.
    for body, param in (({"models": ["a"], "scopes": {"models": ["b"]}}, "models"),
                        ({"scopes": {"rpm": 5}}, "scopes.rpm")):
        status, err = call(server, "POST", "/admin/v1/keys",
                           body={"org_id": org["id"], **body})
        assert status == 400 and err["error"]["param"] == param, err


def test_what_does_not_exist_is_a_404(server: Server) -> None:
    status, org = call(server, "POST", "/admin/v1/orgs", body={"name": "caps"})
    assert status == 201
    status, other = call(server, "POST", "/admin/v1/orgs", body={"name": "caps-other"})
    _, theirs = call(server, "POST", f"/admin/v1/orgs/{other['id']}/projects",
                     body={"name": "theirs"})
    # A project of no org, and one of another org: 404, nothing set.
    for project in ("proj_nope", theirs["id"]):
        status, err = call(server, "POST", f"/admin/v1/orgs/{org['id']}/spend_cap",
                           body={"cap": "5", "project_id": project})
        assert status == 404 and err["error"]["param"] == "project_id", err
    requests: list[tuple[str, str, dict[str, Any] | None]] = [
        ("POST", "/admin/v1/keys", {"org_id": "org_nope"}),
        ("POST", "/admin/v1/users", {"org_id": "org_nope", "email": "a@example.com"}),
        ("POST", "/admin/v1/orgs/org_nope/projects", {"name": "p"}),
        ("POST", "/admin/v1/orgs/org_nope/limits", {"rpm": 1}),
        ("POST", "/admin/v1/orgs/org_nope/credit", {"amount": "1"}),
        ("POST", "/admin/v1/orgs/org_nope/spend_cap", {"cap": "1"}),
        ("GET", "/admin/v1/orgs/org_nope/capture", None),
        ("POST", "/admin/v1/orgs/org_nope/regions", {"allowed_regions": None}),
        ("POST", "/admin/v1/keys/key_nope/revoke", None),
        ("POST", "/admin/v1/keys/key_nope/limits", {"rpm": 1}),
    ]
    for method, path, body in requests:
        status, err = call(server, method, path, body=body)
        assert status == 404 and err["error"]["code"] == "not_found", (path, err)


def test_v1_models_lists_only_what_the_key_may_use(server: Server) -> None:
    """A key scoped to another model, or of an org allowed no region this fleet serves,
    listed every model; each now sees only what it may use, and 404 for the rest."""
    status, org = call(server, "POST", "/admin/v1/orgs", body={"name": "listing"})
    assert status == 201
    keys = {}
    for name, scopes in (("mine", [server.model]), ("other", ["other-model"])):
        status, key = call(server, "POST", "/admin/v1/keys", body={
            "org_id": org["id"], "scopes": {"models": scopes}})
        assert status == 201
        keys[name] = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key["secret"],
                                   max_retries=0)
    assert server.model in [m.id for m in keys["mine"].models.list()]
    assert keys["mine"].models.retrieve(server.model).id == server.model
    assert [m.id for m in keys["other"].models.list()] == []
    with pytest.raises(openai.NotFoundError):
        keys["other"].models.retrieve(server.model)
    # The org may be served only in a region no deployment here declares.
    status, _ = call(server, "POST", f"/admin/v1/orgs/{org['id']}/regions",
                     body={"allowed_regions": ["eu"]})
    assert status == 200
    deadline = time.monotonic() + 5
    while server.model in [m.id for m in keys["mine"].models.list()]:
        assert time.monotonic() < deadline  # key lookups are cached for about 1 s
        time.sleep(0.3)
