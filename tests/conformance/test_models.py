"""GET /v1/models and GET /v1/models/{id} in both dialects against the published specs,
through HTTP on the session's server: OpenAI's `ListModelsResponse` and `Model` for a
request with OpenAI's headers, Anthropic's `ListResponse[ModelInfo]` and `ModelInfo` for
one with the Anthropic SDK's (`anthropic-version`, `x-api-key`); each 404 and 401 in its
API's error shape."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conformance.spec import Spec
from tests.e2e.conftest import Server

ANTHROPIC = {"anthropic-version": "2023-06-01"}


def get(server: Server, path: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.get(server.base_url + path, headers=headers, timeout=30)


def key(server: Server) -> str:
    assert server.api_key is not None  # the session's server runs with auth on
    return server.api_key


def openai_headers(server: Server) -> dict[str, str]:
    return {"Authorization": f"Bearer {key(server)}"}


def anthropic_headers(server: Server) -> dict[str, str]:
    return {"x-api-key": key(server)} | ANTHROPIC


def test_openai_list_and_get_validate(server: Server) -> None:
    spec = Spec.load("openai")
    r = get(server, "/v1/models", openai_headers(server))
    assert r.status_code == 200, r.text
    spec.validate(r.json(), spec.response_schema("/models", 200, "get"), "list")
    assert server.model in [m["id"] for m in r.json()["data"]]
    r = get(server, f"/v1/models/{server.model}", openai_headers(server))
    assert r.status_code == 200, r.text
    spec.validate(r.json(), spec.response_schema("/models/{model}", 200, "get"), "get")
    assert r.json()["id"] == server.model


@pytest.mark.parametrize("headers", [ANTHROPIC, {}], ids=["version", "x-api-key-only"])
def test_anthropic_list_and_get_validate(server: Server, headers: dict[str, str]) -> None:
    spec = Spec.load("anthropic")
    sent = {"x-api-key": key(server)} | headers
    r = get(server, "/v1/models", sent)
    assert r.status_code == 200, r.text
    page = r.json()
    spec.validate(page, spec.response_schema("/v1/models", 200, "get"), "list")
    ids = [m["id"] for m in page["data"]]
    assert server.model in ids and page["first_id"] == ids[0] and page["last_id"] == ids[-1]
    assert page["has_more"] is False
    r = get(server, f"/v1/models/{server.model}", sent)
    assert r.status_code == 200, r.text
    info = r.json()
    spec.validate(info, spec.response_schema("/v1/models/{model_id}", 200, "get"), "get")
    assert info["id"] == server.model and info["max_input_tokens"] > 0


def test_anthropic_pagination(server: Server) -> None:
    r = get(server, "/v1/models?limit=1", anthropic_headers(server))
    assert r.status_code == 200, r.text
    page = r.json()
    assert len(page["data"]) == 1 and page["first_id"] == page["last_id"]
    after = get(server, f"/v1/models?limit=1&after_id={page['last_id']}",
                anthropic_headers(server)).json()
    assert page["last_id"] not in [m["id"] for m in after["data"]]


def _valid_error(r: httpx.Response, status: int, name: str, schema: Any) -> dict[str, Any]:
    assert r.status_code == status, r.text
    spec = Spec.load(name)
    spec.validate(r.json(), schema(spec), f"{name} {status}")
    return dict(r.json())


def test_errors_are_in_each_api_s_shape(server: Server) -> None:
    def openai(spec: Spec) -> Any:
        return "ErrorResponse"

    def anthropic(spec: Spec) -> Any:
        return spec.response_schema("/v1/models/{model_id}", "4XX", "get")

    body = _valid_error(get(server, "/v1/models/no-such-model", openai_headers(server)),
                        404, "openai", openai)
    assert body["error"]["code"] == "model_not_found"
    body = _valid_error(get(server, "/v1/models/no-such-model", anthropic_headers(server)),
                        404, "anthropic", anthropic)
    assert body["error"]["type"] == "not_found_error"
    _valid_error(get(server, "/v1/models", {"Authorization": "Bearer sk-nope"}), 401,
                 "openai", openai)
    body = _valid_error(get(server, "/v1/models", {"x-api-key": "sk-nope"} | ANTHROPIC), 401,
                        "anthropic", anthropic)
    assert body["error"]["type"] == "authentication_error"
    body = _valid_error(get(server, "/v1/models?limit=0", anthropic_headers(server)), 400,
                        "anthropic", anthropic)
    assert body["error"]["type"] == "invalid_request_error"


def test_the_official_sdks_list_and_retrieve_in_their_own_shape(server: Server) -> None:
    """What each SDK sends picks its dialect: the Anthropic SDK's pages parse as
    `ModelInfo`, the OpenAI SDK's as `Model`."""
    import anthropic
    import openai

    claude = anthropic.Anthropic(base_url=server.base_url, api_key=key(server))
    listed = claude.models.list()
    assert server.model in [m.id for m in listed.data]
    info = claude.models.retrieve(server.model)
    assert info.type == "model" and info.display_name == server.model
    gpt = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key(server))
    assert server.model in [m.id for m in gpt.models.list()]
    assert gpt.models.retrieve(server.model).owned_by == "tokenyard"
