"""The second model family over HTTP: `tokenyard serve --model gemma3-270m` completes
through `/v1/completions`, and, being a base model whose GGUF carries no chat template,
refuses chat in each dialect with a 400 that says where to go instead.

Skipped when the Gemma chunk packages are not installed; failed instead when CI is set
(the Makefile installs them)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import in_ci
from tests.e2e.conftest import Server, running_server
from tokenyard.text.model_files import PACKAGED_MODELS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_server() -> Iterator[Server]:
    missing = [p for p in PACKAGED_MODELS["gemma3-270m"].chunk_packages
               if importlib.util.find_spec(p) is None]
    if missing:
        reason = f"Gemma 3 270M chunk packages not installed: {', '.join(missing)}"
        if in_ci():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    with running_server("--model", "gemma3-270m") as (server, _):
        yield server


def test_gemma_completes_over_http(gemma_server: Server) -> None:
    r = httpx.post(gemma_server.base_url + "/v1/completions", headers=gemma_server.headers,
                   json={"model": gemma_server.model, "prompt": "1, 2, 3, 4, 5,",
                         "max_tokens": 6, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"].startswith(" 6, 7"), body
    assert body["usage"]["completion_tokens"] == 6


def test_a_base_model_refuses_chat_in_each_dialect(gemma_server: Server) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    openai = httpx.post(gemma_server.base_url + "/v1/chat/completions",
                        headers=gemma_server.headers, timeout=60,
                        json={"model": gemma_server.model, "messages": messages})
    assert openai.status_code == 400, openai.text
    error = openai.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "model")
    assert "no chat template" in error["message"] and "/v1/completions" in error["message"]
    anthropic = httpx.post(gemma_server.base_url + "/v1/messages",
                           headers=gemma_server.headers, timeout=60,
                           json={"model": gemma_server.model, "messages": messages,
                                 "max_tokens": 8})
    assert anthropic.status_code == 400, anthropic.text
    assert anthropic.json()["error"]["type"] == "invalid_request_error"
    assert "no chat template" in anthropic.json()["error"]["message"]
