"""A hand-written hostile corpus, sent as raw bytes to each generating route (chat,
completions, messages, responses): bodies no SDK would send. Each must be refused with
400 or 413 in the route's own error shape (OpenAI's `{"error": {...}}`, Anthropic's
`{"type": "error", "error": {...}}`) within the client's timeout: never a 500, never a
hang. The few that are valid requests (a bound exactly at its limit, empty content) must
be served. Then the server is quiescent."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.chaos.conftest import Recorder, Scale
from tests.chaos.invariants import check_quiescent
from tests.e2e.conftest import Server

TIMEOUT_S = 60.0
REFUSED = frozenset({400, 413})
Body = dict[str, Any]

def _messages(text: Any) -> Body:
    return {"messages": [{"role": "user", "content": text}]}


#: route → (its fields besides the model and the prompt, a prompt → the prompt's fields).
ROUTES: dict[str, tuple[Body, Callable[[Any], Body]]] = {
    "/v1/chat/completions": ({"max_tokens": 2}, _messages),
    "/v1/completions": ({"max_tokens": 2}, lambda text: {"prompt": text}),
    "/v1/messages": ({"max_tokens": 2}, _messages),
    "/v1/responses": ({"max_output_tokens": 16}, lambda text: {"input": text}),
}

#: Each route's numeric bounds: (field, a value at the bound, a value past it, what else
#: the field needs to be valid).
BOUNDS: dict[str, list[tuple[str, Any, Any, Body]]] = {
    "/v1/chat/completions": [
        ("temperature", 2, 2.0001, {}), ("top_p", 1, 1.01, {}), ("max_tokens", 1, 0, {}),
        ("n", 1, 0, {}), ("presence_penalty", -2, -2.5, {}), ("frequency_penalty", 2, 2.5, {}),
        ("top_logprobs", 20, 21, {"logprobs": True})],
    "/v1/completions": [("temperature", 0, -0.1, {}), ("max_tokens", 1, -1, {}),
                        ("n", 128, 129, {}), ("logprobs", 20, 21, {})],
    "/v1/messages": [("temperature", 1, -1, {}), ("top_p", 1, 1.5, {}), ("top_k", 0, -1, {}),
                     ("max_tokens", 1, 0, {})],
    "/v1/responses": [("temperature", 2, 3, {}), ("top_p", 1, 0, {}),
                      ("max_output_tokens", 16, 0, {})],
}


def _json(body: Body) -> bytes:
    return json.dumps(body).encode()


def corpus(route: str, model: str, scale: Scale) -> Iterator[tuple[str, bytes, frozenset[int]]]:
    """(case, raw body, the statuses it may answer) for `route`."""
    fixed, with_text = ROUTES[route]
    base = {"model": model, **fixed, **with_text("hi")}
    yield "invalid UTF-8", _json(base).replace(b'"hi"', b'"\xff\xfe\xfd"'), REFUSED
    yield "lone surrogate", _json(base).replace(b'"hi"', b'"\\ud800"'), REFUSED
    yield "lone low surrogate in a key", _json(base)[:-1] + b', "\\udc00": 1}', REFUSED
    deep = b"[" * 10_000 + b"]" * 10_000
    yield "JSON nested 10,000 deep", _json(base)[:-1] + b', "metadata": ' + deep + b"}", REFUSED
    yield "not an object", b"[1, 2, 3]", REFUSED
    yield "truncated", _json(base)[:-3], REFUSED
    yield "NaN literal", _json(base)[:-1] + b', "temperature": NaN}', REFUSED
    yield "Infinity literal", _json(base)[:-1] + b', "temperature": Infinity}', REFUSED
    yield "-Infinity literal", _json(base)[:-1] + b', "temperature": -Infinity}', REFUSED
    yield "1e999", _json(base)[:-1] + b', "temperature": 1e999}', REFUSED
    tokens_field = next(f for f in ("max_tokens", "max_output_tokens") if f in base)
    yield "number as a string", _json({**base, tokens_field: "2"}), REFUSED
    yield "number as a float", _json({**base, tokens_field: 2.5}), REFUSED
    yield "number as a bool", _json({**base, tokens_field: True}), REFUSED
    yield "huge integer", _json({**base, tokens_field: 2**70}), REFUSED
    yield "model as a number", _json({**base, "model": 7}), REFUSED
    yield "1 MB single token", _json({**base, **with_text("a" * 1_000_000)}), REFUSED
    yield "5 MB body", _json({**base, **with_text("a " * 2_500_000)}), REFUSED
    yield "empty body", b"", REFUSED
    # Duplicated keys: refused, never read as the first or the last of them.
    yield "duplicated keys", _json(base)[:-1] + b', "model": "no-such-model"}', REFUSED
    yield "duplicated nested keys", _json(base)[:-1] + b', "metadata": {"a": "1", "a": "2"}}', \
        REFUSED
    if route != "/v1/completions":
        role = "messages" if "messages" in base else "input"
        bad_role = [{"role": "wizard", "content": "hi"}]
        yield "unknown role", _json({**base, role: bad_role}), REFUSED
        yield "empty messages", _json({**base, role: []}), REFUSED
        yield "content as a number", _json({**base, role: [{"role": "user", "content": 5}]}), \
            REFUSED
        many = 100_000 if scale == "full" or route == "/v1/chat/completions" else 10_000
        crowd = [{"role": "user", "content": "a"}] * many
        yield f"{many} messages", _json({**base, role: crowd}), REFUSED
    yield "empty content", _json({**base, **with_text("")}), frozenset({200, 400})
    for field, at, past, needs in BOUNDS[route]:
        yield f"{field} at its bound {at}", _json({**base, **needs, field: at}), frozenset({200})
        yield f"{field} past its bound {past}", _json({**base, **needs, field: past}), REFUSED


def _shape_ok(route: str, status: int, body: bytes) -> bool:
    """Whether `body` is the route's error shape (or any JSON object, for a 200)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return False
    if status == 200:
        return isinstance(parsed, dict)
    if route.startswith("/v1/messages"):
        return parsed.get("type") == "error" and isinstance(parsed.get("error"), dict) \
            and isinstance(parsed["error"].get("message"), str)
    return isinstance(parsed.get("error"), dict) and isinstance(parsed["error"].get("message"),
                                                                str)


def _post(server: Server, route: str, raw: bytes) -> tuple[int, bytes, float]:
    url = urlsplit(server.base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=TIMEOUT_S)
    started = time.monotonic()
    try:
        conn.request("POST", route, body=raw,
                     headers={**server.headers, "Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read(), time.monotonic() - started
    finally:
        conn.close()


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_hostile_body_is_refused_in_the_routes_shape_never_500_never_a_hang(
        server: Server, route: str, scale: Scale, record: Recorder) -> None:
    wrong: list[str] = []
    slowest = 0.0
    sent = 0
    for case, raw, allowed in corpus(route, server.model, scale):
        try:
            status, body, took = _post(server, route, raw)
        except (TimeoutError, ConnectionError, http.client.HTTPException) as exc:
            wrong.append(f"{case}: no answer ({exc!r})")
            continue
        sent += 1
        slowest = max(slowest, took)
        if status not in allowed or not _shape_ok(route, status, body):
            wrong.append(f"{case}: {status} {body[:200]!r}")
    assert not wrong, "\n".join(wrong)
    held = check_quiescent(server)
    record(f"hostile bodies on {route}",
           command=f"pytest tests/chaos/test_hostile.py -k '{route}'",
           sent={"bodies": sent},
           held={"refused_or_served_as_allowed": sent, "server_errors": 0,
                 "slowest_answer_s": round(slowest, 2), **held})
