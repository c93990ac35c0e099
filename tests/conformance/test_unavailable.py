"""The unavailable class (OpenAI 503, Anthropic 529) and failures after the 200, through
HTTP, against the published specs.

The gateway is tests/integration/upstreams.py's fleet; its mock OpenAI-compatible
upstream's failures are switched on through the mock's config route. An upstream that
answers 429 (it is overloaded) makes every route answer the API's overloaded error
before any byte of a stream: 503 in OpenAI's `ErrorResponse`, 529 `overloaded_error` in
Anthropic's. An upstream stream cut after its first tokens ends each API's stream the way its spec
says: an `error` object on the chat and completions streams, Anthropic's `error` event,
and the Responses stream's `response.failed` (after which nothing follows).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conformance.spec import Spec, sse_events
from tests.conformance.test_anthropic import validate_event as validate_anthropic_event
from tests.e2e.conftest import Server
from tests.integration.upstreams import MOCK as MODEL
from tests.integration.upstreams import configure_mock as _configure

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Hi"}]
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": ASK, "max_tokens": 8},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 8},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 8},
    "/v1/messages": {"messages": ASK, "max_tokens": 8},
}


def _openai() -> Spec:
    return Spec.load("openai")


def _anthropic() -> Spec:
    return Spec.load("anthropic")


def _headers(server: Server, path: str) -> dict[str, str]:
    if path == "/v1/messages":
        return {"x-api-key": server.api_key or "", "anthropic-version": "2023-06-01"}
    return server.headers


def _post(server: Server, path: str, stream: bool) -> httpx.Response:
    return httpx.post(server.base_url + path, headers=_headers(server, path), timeout=60,
                      json={"model": MODEL, "stream": stream, **ROUTES[path]})


@pytest.fixture()
def overloaded(upstream_fleet: tuple[Server, str]) -> Iterator[Server]:
    server, mock = upstream_fleet
    _configure(mock, inject_429=1.0)
    try:
        yield server
    finally:
        _configure(mock)


@pytest.fixture()
def cut(upstream_fleet: tuple[Server, str]) -> Iterator[Server]:
    server, mock = upstream_fleet
    _configure(mock, inject_stream_error=1.0)
    try:
        yield server
    finally:
        _configure(mock)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("path", list(ROUTES))
def test_an_overloaded_deployment_is_the_apis_unavailable_error(
        overloaded: Server, path: str, stream: bool) -> None:
    r = _post(overloaded, path, stream)
    body = r.json()
    if path == "/v1/messages":
        assert r.status_code == 529, r.text
        _anthropic().validate(body, _anthropic().response_schema(path, "4XX"), "529")
        assert body["error"]["type"] == "overloaded_error"
    else:
        assert r.status_code == 503, r.text
        _openai().validate(body, "ErrorResponse", f"{path} 503")
    assert float(r.headers["retry-after"]) > 0


def _events(server: Server, path: str) -> list[tuple[str | None, dict[str, Any]]]:
    with httpx.stream("POST", server.base_url + path, headers=_headers(server, path),
                      timeout=60, json={"model": MODEL, "stream": True, **ROUTES[path]}) as r:
        assert r.status_code == 200, r.read()
        return list(sse_events(r.iter_lines()))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_openai_stream_cut_after_its_200_ends_with_an_error_object(
        cut: Server, path: str) -> None:
    events = _events(cut, path)
    *chunks, (_, last) = events
    _openai().validate(last, "ErrorResponse", f"{path} stream error")
    assert all("error" not in data for _, data in chunks), chunks


def test_an_anthropic_stream_cut_after_its_200_ends_with_an_error_event(cut: Server) -> None:
    events = _events(cut, "/v1/messages")
    for name, data in events:
        assert data["type"] == name, (name, data)
        validate_anthropic_event(data)
    assert events[0][0] == "message_start" and events[-1][0] == "error", events
    assert events[-1][1]["error"]["type"] in ("api_error", "overloaded_error")


def test_a_responses_stream_cut_after_its_200_ends_with_response_failed(cut: Server) -> None:
    spec = Spec.load("openresponses")
    events = _events(cut, "/v1/responses")
    assert [name for name, _ in events[:2]] == ["response.created", "response.in_progress"]
    name, failed = events[-1]
    assert name == "response.failed", [n for n, _ in events]
    spec.validate(failed, "ResponseFailedStreamingEvent", "response.failed")
    assert failed["response"]["status"] == "failed" and failed["response"]["error"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
