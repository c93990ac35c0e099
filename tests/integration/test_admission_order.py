"""Admission before cost, through HTTP (issue: one owner for the request pipeline).

Nothing expensive runs for a key before it may use the model and is admitted by its
limits and its balance (gateway/pipeline.py's order):

- images (fetch, decode) wait for admission: a key with an empty prepaid balance gets its
  429 `insufficient_quota`, and a key without the model's scope its 403, before any image
  is looked at — an image that cannot be decoded is not what refuses them;
- tokenization waits for the model scope and a byte bound (tests/e2e/
  test_admission_order.py, on the embedded model's real window);
- `/v1/messages/count_tokens` checks the model scope and counts against the key's
  request limit.

Each was shown to fail on the code before the pipeline owned the order: images were
decoded before the balance was read (a 400 for the corrupt image), count_tokens answered
any key.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import anthropic
import openai
import pytest

from tests.e2e.conftest import Server
from tests.e2e.test_gateway import _with_store
from tests.integration.test_image_input import (  # noqa: F401  (the fixture)
    ENGINE,
    VLM,
    FakeUpstream,
    fleet,
)
from tokenyard.store.records import Scopes
from tokenyard.store.repo import Store

#: PNG's signature, then bytes no decoder makes an image of.
CORRUPT_PNG = b"\x89PNG\r\n\x1a\n" + b"\x00not really a png" * 64


def new_key(server: Server, *, balance: int | None = None, scopes: Scopes = Scopes(),  # noqa: B008
         **key_args: Any) -> str:
    assert server.state_dir is not None

    async def create(store: Store) -> str:
        org = await store.create_org(f"order-{time.monotonic_ns()}", balance_micros=balance)
        secret, _ = await store.create_api_key(org.id, name="order", scopes=scopes,
                                               **key_args)
        return secret

    return _with_store(server.state_dir, create)


def _corrupt_image_chat(server: Server, secret: str) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=secret, max_retries=0)
    uri = "data:image/png;base64," + base64.b64encode(CORRUPT_PNG).decode()
    client.chat.completions.create(model=VLM, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                     {"type": "image_url", "image_url": {"url": uri}}]}])


def test_an_empty_balance_is_refused_before_its_images_are_decoded(
    fleet: tuple[Server, FakeUpstream],  # noqa: F811
) -> None:
    server, upstream = fleet
    sent = len(upstream.bodies)
    with pytest.raises(openai.RateLimitError) as refused:
        _corrupt_image_chat(server, new_key(server, balance=0))
    assert refused.value.code == "insufficient_quota"
    assert len(upstream.bodies) == sent
    # Admitted, the same image is looked at: the 400 names the part.
    with pytest.raises(openai.BadRequestError) as bad:
        _corrupt_image_chat(server, new_key(server))
    assert "image" in bad.value.message


def test_a_key_outside_the_models_scope_is_refused_before_its_images_are_decoded(
    fleet: tuple[Server, FakeUpstream],  # noqa: F811
) -> None:
    server, _ = fleet
    with pytest.raises(openai.PermissionDeniedError) as refused:
        _corrupt_image_chat(server, new_key(server, scopes=Scopes(models=("gpt-*",))))
    assert "scope 'models'" in refused.value.message


def test_count_tokens_checks_the_models_scope_and_the_request_limit(
    fleet: tuple[Server, FakeUpstream],  # noqa: F811
) -> None:
    server, _ = fleet
    messages: Any = [{"role": "user", "content": "Count me."}]

    def client(secret: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=server.base_url, api_key=secret, max_retries=0)

    denied = new_key(server, scopes=Scopes(models=("gpt-*",)))
    with pytest.raises(anthropic.PermissionDeniedError):
        client(denied).messages.count_tokens(model=ENGINE, messages=messages)
    limited = new_key(server, rpm=1)
    counted = client(limited).messages.count_tokens(model=ENGINE, messages=messages)
    assert counted.input_tokens > 0
    with pytest.raises(anthropic.RateLimitError):
        client(limited).messages.count_tokens(model=ENGINE, messages=messages)
