"""Whose replay an Idempotency-Key is (issue 21, finding 10), against a real `tokenyard
serve`: a stored response is replayed only to the API key that made the request and only
on the route it was made on. Another key of the same org with the same Idempotency-Key and
body is a request of its own (authorized, run and billed as such: a key that may not use
the model gets 403, never the stored body); the same key and bytes on another route are
422 `idempotency_key_reused`, like another body."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp

from tests.e2e.conftest import Server
from tests.e2e.test_admin_http import call

HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]


def _keys(server: Server, *scoped: list[str] | None) -> list[str]:
    """A fresh org and one key in it per entry of `scoped` (its model scope; None: every
    model): their secrets."""
    status, org = call(server, "POST", "/admin/v1/orgs",
                       body={"name": f"idem-{uuid.uuid4().hex[:8]}"})
    assert status == 201, org
    secrets = []
    for models in scoped:
        body: dict[str, Any] = {"org_id": org["id"]}
        if models is not None:
            body["models"] = models
        status, key = call(server, "POST", "/admin/v1/keys", body=body)
        assert status == 201, key
        secrets.append(key["secret"])
    return secrets


def _post(server: Server, path: str, secret: str, idem: str, body: bytes
          ) -> tuple[int, dict[str, str], bytes]:
    async def main() -> tuple[int, dict[str, str], bytes]:
        headers = {"Authorization": f"Bearer {secret}", "Idempotency-Key": idem,
                   "Content-Type": "application/json", "anthropic-version": "2023-06-01"}
        async with aiohttp.ClientSession() as session, session.post(
            server.base_url + path, data=body, headers=headers
        ) as r:
            return r.status, dict(r.headers), await r.read()

    return asyncio.run(main())


def _body(server: Server) -> bytes:
    """A body both /v1/chat/completions and /v1/messages accept."""
    return json.dumps({"model": server.model, "messages": HELLO, "max_tokens": 4,
                       "temperature": 1.0}).encode()


def test_a_key_that_may_not_use_the_model_never_gets_another_key_s_stored_response(
    server: Server,
) -> None:
    owner, barred, other = _keys(server, None, ["no-such-model-*"], None)
    idem, body = f"idem-{uuid.uuid4().hex}", _body(server)
    status, headers, stored = _post(server, "/v1/chat/completions", owner, idem, body)
    assert status == 200 and "Idempotent-Replayed" not in headers, stored

    status, headers, raw = _post(server, "/v1/chat/completions", barred, idem, body)
    assert status == 403, raw
    assert "Idempotent-Replayed" not in headers and raw != stored
    error = json.loads(raw)["error"]
    assert error["type"] == "permission_error"
    assert "may not use model" in error["message"]

    # A key of the same org that may use the model runs the request as its own.
    status, headers, raw = _post(server, "/v1/chat/completions", other, idem, body)
    assert status == 200 and "Idempotent-Replayed" not in headers
    assert json.loads(raw)["id"] != json.loads(stored)["id"]

    # The owner's replay is untouched by either.
    status, headers, again = _post(server, "/v1/chat/completions", owner, idem, body)
    assert status == 200 and headers["Idempotent-Replayed"] == "true" and again == stored


def test_the_same_key_and_bytes_on_another_route_are_not_a_replay(server: Server) -> None:
    [secret] = _keys(server, None)
    idem, body = f"idem-{uuid.uuid4().hex}", _body(server)
    status, _, chat = _post(server, "/v1/chat/completions", secret, idem, body)
    assert status == 200 and json.loads(chat)["object"] == "chat.completion"

    status, headers, raw = _post(server, "/v1/messages", secret, idem, body)
    assert status == 422, raw
    assert "Idempotent-Replayed" not in headers and raw != chat
    error = json.loads(raw)  # in the Anthropic route's own shape
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "POST /v1/chat/completions" in error["error"]["message"]

    # The chat route still replays its own response.
    status, headers, again = _post(server, "/v1/chat/completions", secret, idem, body)
    assert status == 200 and headers["Idempotent-Replayed"] == "true" and again == chat
