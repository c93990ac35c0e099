"""The gateway end to end (issue 4 §7): keys, scopes, limits, billing, the ledger,
idempotency, crash safety and limits shared through Redis, against real `tokenyard serve`
processes and the official `openai` and `anthropic` SDKs.

Orgs, keys, limits, prices and credit are set up with `tokenyard.store.Store` over the very
SQLite file the server uses (`<state dir>/tokenyard.db`). The gateway caches key lookups for
up to 1 s, billing figures for 1 s and prices for 10 s, so tests that change the database
poll with a deadline; prices are set before the module's server admits any request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import aiohttp
import anthropic
import openai
import pytest
from sqlalchemy import select

from tests.e2e.conftest import START_TIMEOUT_S, Server, child_pids, running_server
from tokenyard.store import Database, Prices, Scopes, Store, cost_micros
from tokenyard.store.tables import usage_ledger

pytestmark = pytest.mark.slow

T = TypeVar("T")

#: Deliberately odd prices (micros per million tokens), so that rounding shows.
PRICES = Prices(input=2_500_001, cached_input=1_250_003, output=10_000_007)
HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]
REDIS_PREFIX = "{tokenyard:rl:}"  # RedisLimiter's default prefix, as a hash tag


# ---------------------------------------------------------------------------- helpers


def _db_url(state_dir: str) -> str:
    return f"sqlite+aiosqlite:///{state_dir}/tokenyard.db"


@contextlib.asynccontextmanager
async def _open_store(state_dir: str, *, upgrade: bool = False) -> AsyncIterator[Store]:
    db = await Database.open(_db_url(state_dir), upgrade=upgrade)
    try:
        yield Store(db)
    finally:
        await db.close()


def _with_store(state_dir: str, fn: Callable[[Store], Awaitable[T]], *,
                upgrade: bool = False) -> T:
    """Run `fn(store)` over the server's database, in an event loop of its own."""
    async def main() -> T:
        async with _open_store(state_dir, upgrade=upgrade) as store:
            return await fn(store)

    return asyncio.run(main())


def _ledger_rows(state_dir: str, key_id: str | None = None) -> list[dict[str, Any]]:
    """Ledger rows (of one key, if given) in the order they were written."""
    async def read(store: Store) -> list[dict[str, Any]]:
        query = select(usage_ledger).order_by(usage_ledger.c.id)
        if key_id is not None:
            query = query.where(usage_ledger.c.key_id == key_id)
        async with store.db.engine.connect() as conn:
            return [dict(row) for row in (await conn.execute(query)).mappings()]

    return _with_store(state_dir, read)


def _poll(fn: Callable[[], T], done: Callable[[T], bool], timeout: float, what: str,
          interval: float = 0.05) -> T:
    """Call `fn` until `done(result)`, at most `timeout` seconds; fail saying `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if done(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s (last: {value!r})")
        time.sleep(interval)


def _ledger_wait(state_dir: str, key_id: str, n: int, timeout: float = 5.0
                 ) -> list[dict[str, Any]]:
    """The key's ledger rows once at least `n` are there (the writer flushes in batches)."""
    return _poll(lambda: _ledger_rows(state_dir, key_id), lambda rows: len(rows) >= n,
                 timeout, f"{n} ledger rows of {key_id}")


@dataclass(frozen=True)
class Gw:
    """The module's server and its state directory (its SQLite file)."""

    server: Server
    state_dir: str

    @property
    def model(self) -> str:
        return self.server.model

    def openai_client(self, key: str | None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.base_url + "/v1", api_key=key or "unused",
                             max_retries=0)

    def anthropic_client(self, key: str | None) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.server.base_url, api_key=key or "unused",
                                   max_retries=0)

    def new_key(self, *, balance: int | None = None, scopes: Scopes = Scopes(),  # noqa: B008
                **key_args: Any) -> tuple[str, str, str]:
        """A fresh org (prepaid with `balance` micros, else postpaid) and a key in it:
        (secret, key id, org id)."""
        async def create(store: Store) -> tuple[str, str, str]:
            org = await store.create_org(f"e2e-{uuid.uuid4().hex[:8]}", balance_micros=balance)
            secret, key = await store.create_api_key(org.id, name="e2e", scopes=scopes,
                                                     **key_args)
            return secret, key.id, org.id

        return _with_store(self.state_dir, create)

    def chat(self, key: str, *, max_tokens: int = 1, messages: Any = HELLO, **kw: Any) -> Any:
        """A non-streamed chat completion through the SDK, as a raw response (headers)."""
        return self.openai_client(key).chat.completions.with_raw_response.create(
            model=self.model, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


@pytest.fixture(scope="module")
def gw() -> Iterator[Gw]:
    state = tempfile.mkdtemp(prefix="tokenyard-e2e-gw-")
    try:
        with running_server(state_dir=state) as (server, _):
            # Before any request: the gateway reads prices on its first admission.
            _with_store(state, lambda store: store.set_price(
                server.model, input=PRICES.input, cached_input=PRICES.cached_input,
                output=PRICES.output))
            yield Gw(server, state)
    finally:
        shutil.rmtree(state, ignore_errors=True)


def _prompt_tokens(gw: Gw, messages: Any = HELLO) -> int:
    """The templated prompt's length on the chat route (asked with the dev key)."""
    return _prompt_tokens_of(gw, gw.server.api_key or "", messages)


def _prompt_tokens_of(gw: Gw, key: str, messages: Any = HELLO) -> int:
    """The templated prompt's length on the chat route, asked with `key`."""
    usage = gw.chat(key, messages=messages).parse().usage
    assert usage is not None
    return int(usage.prompt_tokens)


# ---------------------------------------------------------------------------- 401


def test_missing_or_unknown_key_is_401_in_each_routes_shape(gw: Gw) -> None:
    no_key = gw.openai_client(None)
    with pytest.raises(openai.AuthenticationError) as missing:
        no_key.chat.completions.create(model=gw.model, messages=HELLO, max_tokens=1,
                                       extra_headers={"Authorization": openai.Omit()})
    assert missing.value.status_code == 401
    assert missing.value.type == "authentication_error"
    assert "didn't provide an API key" in missing.value.message

    wrong = "sk-ty-" + "x" * 40
    with pytest.raises(openai.AuthenticationError) as unknown:
        gw.openai_client(wrong).chat.completions.create(model=gw.model, messages=HELLO,
                                                        max_tokens=1)
    body = unknown.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "authentication_error" and body["code"] == "invalid_api_key"
    assert "Incorrect API key" in body["message"] and wrong not in body["message"]

    with pytest.raises(anthropic.AuthenticationError) as unknown_a:
        gw.anthropic_client(wrong).messages.create(model=gw.model, messages=HELLO, max_tokens=1)
    body_a = unknown_a.value.body
    assert isinstance(body_a, dict) and body_a["type"] == "error"
    assert body_a["error"]["type"] == "authentication_error"
    assert "Incorrect API key" in body_a["error"]["message"]
    assert wrong not in body_a["error"]["message"]

    async def anthropic_without_key() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session, session.post(
            gw.server.base_url + "/v1/messages",
            json={"model": gw.model, "messages": HELLO, "max_tokens": 1},
            headers={"anthropic-version": "2023-06-01"},
        ) as r:
            return r.status, await r.json()

    status, raw = asyncio.run(anthropic_without_key())
    assert status == 401 and raw["type"] == "error"
    assert raw["error"]["type"] == "authentication_error"
    assert "didn't provide an API key" in raw["error"]["message"]


def test_a_key_revoked_in_the_database_stops_working_within_a_second(gw: Gw) -> None:
    secret, key_id, _ = gw.new_key()
    assert gw.chat(secret).http_response.status_code == 200
    assert _with_store(gw.state_dir, lambda store: store.revoke_key(key_id))
    revoked_at = time.monotonic()

    def attempt() -> Exception | None:
        try:
            gw.chat(secret)
        except openai.AuthenticationError as exc:
            return exc
        return None

    refusal = _poll(attempt, lambda exc: exc is not None, 3.0, "401 for the revoked key")
    # The key cache holds a lookup for at most 1 s (plus a request or two here).
    assert time.monotonic() - revoked_at <= 2.0
    assert isinstance(refusal, openai.AuthenticationError) and "revoked" in refusal.message
    with pytest.raises(anthropic.AuthenticationError, match="revoked"):
        gw.anthropic_client(secret).messages.create(model=gw.model, messages=HELLO, max_tokens=1)


def test_an_expired_key_is_401_and_an_unexpired_one_works(gw: Gw) -> None:
    now = datetime.now(UTC)
    expired, _, _ = gw.new_key(expires_at=now - timedelta(seconds=1))
    valid, _, _ = gw.new_key(expires_at=now + timedelta(hours=1))
    with pytest.raises(openai.AuthenticationError, match="expired") as refused:
        gw.chat(expired)
    assert refused.value.status_code == 401
    with pytest.raises(anthropic.AuthenticationError, match="expired"):
        gw.anthropic_client(expired).messages.create(model=gw.model, messages=HELLO, max_tokens=1)
    assert gw.chat(valid).http_response.status_code == 200


# ---------------------------------------------------------------------------- 403


def test_a_model_outside_the_keys_models_scope_is_403_naming_the_scope(gw: Gw) -> None:
    denied, _, _ = gw.new_key(scopes=Scopes(models=("gpt-*", "claude-*")))
    allowed, _, _ = gw.new_key(scopes=Scopes(models=("gpt-*", gw.model.split("-")[0] + "-*")))
    with pytest.raises(openai.PermissionDeniedError) as refused:
        gw.chat(denied)
    err = refused.value
    assert err.status_code == 403 and err.type == "permission_error"
    assert "scope 'models'" in err.message and gw.model in err.message
    with pytest.raises(anthropic.PermissionDeniedError) as refused_a:
        gw.anthropic_client(denied).messages.create(model=gw.model, messages=HELLO, max_tokens=1)
    body = refused_a.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "permission_error"
    assert "scope 'models'" in body["error"]["message"]
    # A glob that matches the model lets it through.
    assert gw.chat(allowed).http_response.status_code == 200


def test_prompt_plus_max_tokens_above_max_context_tokens_is_403(gw: Gw) -> None:
    prompt = _prompt_tokens(gw)
    cap = prompt + 4
    secret, _, _ = gw.new_key(scopes=Scopes(max_context_tokens=cap))
    # Exactly at the cap: admitted.
    assert gw.chat(secret, max_tokens=4).http_response.status_code == 200
    with pytest.raises(openai.PermissionDeniedError) as refused:
        gw.chat(secret, max_tokens=5)
    message = refused.value.message
    assert "scope 'max_context_tokens'" in message
    assert f"at most {cap}" in message and f"needs {cap + 1}" in message


def test_max_context_tokens_caps_each_completions_context_not_n_times_max_tokens(
    gw: Gw,
) -> None:
    prompt = _prompt_tokens(gw)
    secret, _, _ = gw.new_key(scopes=Scopes(max_context_tokens=prompt + 4))
    # Each of the two completions sees prompt + 4 tokens at most: within the scope.
    r = gw.chat(secret, max_tokens=4, n=2)
    assert r.http_response.status_code == 200 and len(r.parse().choices) == 2


# ---------------------------------------------------------------------------- 429 limits


_OPENAI_RESET = re.compile(r"^(\d+ms|(\d+h)?(\d+m)?\d+s)$")


def test_rpm_limit_refuses_the_third_request_with_openai_headers(gw: Gw) -> None:
    secret, key_id, _ = gw.new_key(rpm=2, tpm=100_000)
    first = gw.chat(secret, max_tokens=3)
    usage = first.parse().usage
    h = first.headers
    assert h["x-ratelimit-limit-requests"] == "2"
    assert h["x-ratelimit-remaining-requests"] == "1"
    assert h["x-ratelimit-reset-requests"] == "30s"  # one request back in 60/2 s
    assert h["x-ratelimit-limit-tokens"] == "100000"
    # Measured right after this request's reservation: prompt + max_tokens.
    assert h["x-ratelimit-remaining-tokens"] == str(100_000 - (usage.prompt_tokens + 3))
    assert _OPENAI_RESET.match(h["x-ratelimit-reset-tokens"])
    second = gw.chat(secret).headers
    assert second["x-ratelimit-remaining-requests"] == "0"
    assert _OPENAI_RESET.match(second["x-ratelimit-reset-requests"])

    with pytest.raises(openai.RateLimitError) as refused:
        gw.chat(secret)
    err = refused.value
    assert err.status_code == 429 and err.code == "rate_limit_exceeded"
    assert err.type == "rate_limit_error"
    assert f"key {key_id} on requests per min (RPM)" in err.message
    assert "Limit 2, Used 2, Requested 1" in err.message
    headers = err.response.headers
    # The next request fits once half a minute's refill (one request) is in.
    retry_ms = int(headers["retry-after-ms"])
    assert 20_000 < retry_ms <= 30_000
    assert int(headers["retry-after"]) == math.ceil(retry_ms / 1000)
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"


def test_rpm_limit_on_the_messages_route_uses_anthropic_headers(gw: Gw) -> None:
    secret, key_id, _ = gw.new_key(rpm=1, tpm=50_000)
    client = gw.anthropic_client(secret)
    ok = client.messages.with_raw_response.create(model=gw.model, messages=HELLO,
                                                  max_tokens=2)
    h = ok.headers
    assert h["anthropic-ratelimit-requests-limit"] == "1"
    assert h["anthropic-ratelimit-requests-remaining"] == "0"
    reset = datetime.fromisoformat(h["anthropic-ratelimit-requests-reset"].replace("Z", "+00:00"))
    assert timedelta(seconds=55) <= reset - datetime.now(UTC) <= timedelta(seconds=62)
    assert h["anthropic-ratelimit-tokens-limit"] == "50000"
    assert int(h["anthropic-ratelimit-tokens-remaining"]) < 50_000
    assert "x-ratelimit-limit-requests" not in h

    with pytest.raises(anthropic.RateLimitError) as refused:
        client.messages.create(model=gw.model, messages=HELLO, max_tokens=2)
    err = refused.value
    body = err.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error"
    assert f"key {key_id}" in body["error"]["message"]
    assert "Limit 1, Used 1, Requested 1" in body["error"]["message"]
    headers = err.response.headers
    assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) > 0
    assert headers["anthropic-ratelimit-requests-limit"] == "1"
    assert headers["anthropic-ratelimit-requests-remaining"] == "0"


def test_a_finished_request_charges_its_real_usage_not_its_reservation(gw: Gw) -> None:
    tpm = 10_000
    # A long prompt, cached first so the requests below are fast: the refill over their
    # time must stay well below the first request's real usage. The prefix cache is per
    # org, so another key of the same org (without limits) warms it.
    long_prompt = [{"role": "user", "content": "Reply with one word. " + "lorem ipsum " * 300}]
    secret, _, org_id = gw.new_key(tpm=tpm)
    warm, _ = _with_store(gw.state_dir, lambda store: store.create_api_key(org_id, name="warm"))
    _prompt_tokens_of(gw, warm, long_prompt)
    max_tokens1, max_tokens2 = 1000, 1  # within the deployment's output cap (1024)
    began = time.monotonic()
    # Stop strings end the reply within a few tokens: far below max_tokens.
    first = gw.chat(secret, messages=long_prompt, max_tokens=max_tokens1,
                    stop=[" ", "\n", ".", ",", "!"])
    second = gw.chat(secret, messages=long_prompt, max_tokens=max_tokens2)
    elapsed = time.monotonic() - began
    usage1, usage2 = first.parse().usage, second.parse().usage
    assert usage1.completion_tokens < 50, "the first reply was meant to stop early"
    assert usage1.prompt_tokens_details.cached_tokens > 0, "the warm-up was meant to hit"
    reserved1 = usage1.prompt_tokens + max_tokens1
    # The first request's reservation, right after it was taken from a full bucket.
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == tpm - reserved1
    remaining2 = int(second.headers["x-ratelimit-remaining-tokens"])
    expected = tpm - usage1.total_tokens - (usage2.prompt_tokens + max_tokens2)
    refill = tpm / 60 * elapsed
    assert refill < reserved1 - usage1.total_tokens  # else the test could not tell
    assert expected <= remaining2 <= expected + refill + 1, (
        f"remaining {remaining2}: expected {expected} (+ up to {refill:.0f} refill); "
        f"charging the reservation would leave about {tpm - reserved1 - usage2.total_tokens}"
    )


# ---------------------------------------------------------------------------- billing


def test_billing_refuses_an_empty_balance_then_meters_every_request_exactly(gw: Gw) -> None:
    secret, key_id, org_id = gw.new_key(balance=0)
    with pytest.raises(openai.RateLimitError) as refused:
        gw.chat(secret)
    err = refused.value
    assert err.status_code == 429 and err.code == "insufficient_quota"
    assert err.response.headers["x-should-retry"] == "false"
    assert "balance" in err.message
    # Anthropic's dialect: its billing error (402), not a rate limit.
    with pytest.raises(anthropic.PaymentRequiredError) as refused_a:
        gw.anthropic_client(secret).messages.create(model=gw.model, messages=HELLO, max_tokens=1)
    assert refused_a.value.body["error"]["type"] == "billing_error"  # type: ignore[index]
    assert refused_a.value.response.headers["x-should-retry"] == "false"

    credit = 10_000_000
    assert _with_store(gw.state_dir, lambda store: store.add_credit(org_id, credit)) == credit
    # (endpoint, prompt tokens, cached tokens, output tokens) as each response reports them.
    seen: list[tuple[str, int, int, int]] = []

    def chat_once() -> Any:
        try:
            return gw.chat(secret, max_tokens=5).parse()
        except openai.RateLimitError as exc:
            assert exc.code == "insufficient_quota"  # until the refreshed balance shows
            return None

    first = _poll(chat_once, lambda r: r is not None, 5.0, "admission after the credit")
    # The second one reads its prompt from the prefix cache.
    for reply in (first, gw.chat(secret, max_tokens=5).parse()):
        u = reply.usage
        seen.append(("/v1/chat/completions", u.prompt_tokens,
                     u.prompt_tokens_details.cached_tokens, u.completion_tokens))

    chunks = list(gw.openai_client(secret).chat.completions.create(
        model=gw.model, messages=HELLO, max_tokens=7, stream=True,
        stream_options={"include_usage": True}))
    u = chunks[-1].usage
    assert u is not None
    seen.append(("/v1/chat/completions", u.prompt_tokens,
                 u.prompt_tokens_details.cached_tokens, u.completion_tokens))

    claude = gw.anthropic_client(secret)
    message = claude.messages.create(model=gw.model, messages=HELLO, max_tokens=6)
    with claude.messages.stream(model=gw.model, messages=HELLO, max_tokens=4) as stream:
        streamed = stream.get_final_message()
    for mu in (message.usage, streamed.usage):
        # Anthropic's input_tokens leave out the tokens read from the cache.
        cached = mu.cache_read_input_tokens or 0
        seen.append(("/v1/messages", mu.input_tokens + cached, cached, mu.output_tokens))

    rows = _ledger_wait(gw.state_dir, key_id, len(seen))
    assert len(rows) == len(seen)
    total = 0
    for row, (endpoint, prompt, cached, output) in zip(rows, seen, strict=True):
        assert (row["endpoint"], row["prompt_tokens"], row["cached_tokens"],
                row["output_tokens"]) == (endpoint, prompt, cached, output)
        assert row["org_id"] == org_id and row["model"] == gw.model
        assert row["status"] in ("completed", "stopped")
        cost = cost_micros(PRICES, prompt - cached, cached, output)
        assert cost > 0 and row["cost_micros"] == cost
        total += cost
    assert any(c for _, _, c, _ in seen), "no request read the prefix cache"
    balance = _with_store(gw.state_dir, lambda store: store.balance(org_id))
    assert balance == credit - total


def test_a_free_tier_allows_its_daily_requests_then_refuses(gw: Gw) -> None:
    async def create(store: Store) -> str:
        org = await store.create_org(f"free-{uuid.uuid4().hex[:8]}",
                                     free_tier_daily_requests=2)
        secret, _ = await store.create_api_key(org.id, name="free")
        return secret

    secret = _with_store(gw.state_dir, create)
    for _ in range(2):
        assert gw.chat(secret).http_response.status_code == 200
    with pytest.raises(openai.RateLimitError) as refused:
        gw.chat(secret)
    assert refused.value.code == "insufficient_quota" and "free tier" in refused.value.message
    assert refused.value.response.headers["x-should-retry"] == "false"


def test_an_org_over_its_monthly_spend_cap_is_refused(gw: Gw) -> None:
    secret, _, org_id = gw.new_key()  # postpaid: only the cap stops it
    _with_store(gw.state_dir, lambda store: store.set_spend_cap(org_id, None, 1))
    assert gw.chat(secret).http_response.status_code == 200  # spent 0 < 1 micro
    with pytest.raises(openai.RateLimitError) as refused:
        gw.chat(secret)
    assert refused.value.code == "insufficient_quota" and "spend cap" in refused.value.message


# ---------------------------------------------------------------------------- idempotency


async def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
        url, data=body, headers={"Content-Type": "application/json", **headers}
    ) as r:
        return r.status, r.headers, await r.read()


def _idem_post(gw: Gw, secret: str, body: dict[str, Any], idem: str | None
               ) -> tuple[int, Any, bytes]:
    headers = {"Authorization": f"Bearer {secret}"}
    if idem is not None:
        headers["Idempotency-Key"] = idem
    raw = json.dumps(body).encode()
    return asyncio.run(_post(gw.server.base_url + "/v1/chat/completions", raw, headers))


def _billed_once(gw: Gw, secret: str, key_id: str) -> list[dict[str, Any]]:
    """The key's ledger rows once a later request's row is in (the writer commits in
    order, so a second row of the idempotent request would be in by then too)."""
    status, _, raw = _idem_post(gw, secret, {"model": gw.model, "messages": HELLO,
                                             "max_tokens": 1}, None)
    assert status == 200, raw
    rows = _ledger_wait(gw.state_dir, key_id, 2)
    assert rows[-1]["output_tokens"] == json.loads(raw)["usage"]["completion_tokens"]
    return rows[:-1]


def test_same_idempotency_key_and_body_replays_the_response_and_bills_once(gw: Gw) -> None:
    secret, key_id, _ = gw.new_key()
    body = {"model": gw.model, "messages": HELLO, "max_tokens": 6, "temperature": 1.0}
    idem = f"idem-{uuid.uuid4().hex}"
    status1, headers1, raw1 = _idem_post(gw, secret, body, idem)
    status2, headers2, raw2 = _idem_post(gw, secret, body, idem)
    assert status1 == status2 == 200
    assert "Idempotent-Replayed" not in headers1
    assert headers2["Idempotent-Replayed"] == "true"
    assert raw2 == raw1  # the stored bytes: same id, same sampled text
    rows = _billed_once(gw, secret, key_id)
    usage = json.loads(raw1)["usage"]
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in rows] == [
        (usage["prompt_tokens"], usage["completion_tokens"])]


def test_same_idempotency_key_with_another_body_is_422(gw: Gw) -> None:
    secret, _, _ = gw.new_key()
    body = {"model": gw.model, "messages": HELLO, "max_tokens": 2}
    idem = f"idem-{uuid.uuid4().hex}"
    status, _, raw = _idem_post(gw, secret, body, idem)
    assert status == 200
    status, _, raw_err = _idem_post(gw, secret, {**body, "max_tokens": 3}, idem)
    assert status == 422
    error = json.loads(raw_err)["error"]
    assert error["code"] == "idempotency_key_reused" and "Idempotency-Key" in error["message"]
    # The original request is still replayable under its key.
    status, headers, again = _idem_post(gw, secret, body, idem)
    assert status == 200 and headers["Idempotent-Replayed"] == "true" and again == raw


def test_a_streamed_idempotent_request_replays_the_same_sse_bytes(gw: Gw) -> None:
    secret, key_id, _ = gw.new_key()
    body = {"model": gw.model, "messages": HELLO, "max_tokens": 6, "temperature": 1.0,
            "stream": True, "stream_options": {"include_usage": True}}
    idem = f"idem-{uuid.uuid4().hex}"
    status1, headers1, raw1 = _idem_post(gw, secret, body, idem)
    status2, headers2, raw2 = _idem_post(gw, secret, body, idem)
    assert status1 == status2 == 200
    assert "Idempotent-Replayed" not in headers1
    assert headers2["Idempotent-Replayed"] == "true"
    assert headers2["Content-Type"].startswith("text/event-stream")
    assert raw1.endswith(b"data: [DONE]\n\n") and raw2 == raw1
    events = [json.loads(e[6:]) for e in raw1.split(b"\n\n")
              if e.startswith(b"data: {")]
    usage = events[-1]["usage"]
    rows = _billed_once(gw, secret, key_id)
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in rows] == [
        (usage["prompt_tokens"], usage["completion_tokens"])]


def test_a_retry_while_the_first_request_still_runs_is_409(gw: Gw) -> None:
    secret, _, _ = gw.new_key()
    url = gw.server.base_url + "/v1/chat/completions"
    body = {"model": gw.model, "messages": HELLO, "max_tokens": 16, "stream": True}
    headers = {"Authorization": f"Bearer {secret}", "Idempotency-Key": uuid.uuid4().hex}

    async def main() -> tuple[int, Any, Any, bytes, int, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=body, headers=headers) as first:
                await first.content.readline()  # the stream began: the key is held
                async with session.post(url, json=body, headers=headers) as second:
                    during = second.status, second.headers, await second.json()
                streamed = await first.read()
            async with session.post(url, json=body, headers=headers) as third:
                return (*during, streamed, third.status, third.headers)

    status, h, err, streamed, status3, h3 = asyncio.run(main())
    assert status == 409 and err["error"]["code"] == "idempotency_key_in_use"
    assert h["retry-after"] == "1"
    assert streamed.endswith(b"data: [DONE]\n\n")
    assert status3 == 200 and h3["Idempotent-Replayed"] == "true"


# ---------------------------------------------------------------------------- crash safety


def _kill_9(proc: subprocess.Popen[str], replicas: list[int]) -> None:
    """kill -9 the `tokenyard serve` process, then its replica (which would otherwise get
    the parent-death SIGTERM and drain)."""
    proc.kill()
    for pid in replicas:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL


# Shorter: tests/chaos/test_kills.py kills a gateway worker and loses no usage.
@pytest.mark.long
def test_kill_9_of_the_gateway_after_n_completed_requests_leaves_n_ledger_rows() -> None:
    n = 5
    state = tempfile.mkdtemp(prefix="tokenyard-e2e-crash-")
    try:
        with running_server(state_dir=state, check_exit=False) as (server, proc):
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                                   max_retries=0)
            replicas = child_pids(proc.pid)
            usages = []
            for i in range(n - 1):
                r = client.chat.completions.create(model=server.model, messages=HELLO,
                                                   max_tokens=2 + i, temperature=0)
                usages.append(r.usage)
            # The last one streamed: complete for its client once it has read [DONE].
            chunks = list(client.chat.completions.create(
                model=server.model, messages=HELLO, max_tokens=2 + n, temperature=0,
                stream=True, stream_options={"include_usage": True}))
            usages.append(chunks[-1].usage)
            _kill_9(proc, replicas)  # right after the last response: no time to flush
        flushed_before = len(_ledger_rows(state))
        assert flushed_before <= n
        with running_server(state_dir=state) as (again, _):
            rows = _ledger_rows(state)
            assert len(rows) == n, f"{len(rows)} rows after restart ({flushed_before} before)"
            assert [(r["prompt_tokens"], r["output_tokens"]) for r in rows] == [
                (u.prompt_tokens, u.completion_tokens) for u in usages]
            assert len({r["request_id"] for r in rows}) == n
            # The restarted gateway still knows the key and serves it.
            ok = openai.OpenAI(base_url=again.base_url + "/v1", api_key=server.api_key,
                               max_retries=0).chat.completions.create(
                model=again.model, messages=HELLO, max_tokens=1)
            assert ok.usage is not None
    finally:
        shutil.rmtree(state, ignore_errors=True)


# ---------------------------------------------------------------------------- Redis


_MOCK = re.compile(r"serving at (http://\S+)")


@contextlib.contextmanager
def _mock_replica() -> Iterator[str]:
    cmd = [sys.executable, "-m", "tokenyard.bench.mock_replica", "--port", "0",
           "--output-len", "1", "--ttft-ms", "0", "--itl-ms", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if m := _MOCK.search(line):
                yield m.group(1)
                break
        else:
            pytest.fail("the mock replica did not start:\n" + "".join(seen[-40:]))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_two_gateways_sharing_redis_admit_at_most_one_limit_together(redis_url: str) -> None:
    import redis

    rpm, total = 50, 200
    state = tempfile.mkdtemp(prefix="tokenyard-e2e-redis-")
    key_id = ""
    try:
        async def setup(store: Store) -> tuple[str, str]:
            org = await store.create_org("redis-e2e")
            secret, key = await store.create_api_key(org.id, name="shared", rpm=rpm)
            return secret, key.id

        secret, key_id = _with_store(state, setup, upgrade=True)
        env = {"TOKENYARD_REDIS_URL": redis_url}
        with _mock_replica() as replica, \
                running_server("--replica-url", replica, env=env, state_dir=state) as (a, _), \
                running_server("--replica-url", replica, env=env, state_dir=state) as (b, _):
            body = {"model": a.model, "messages": HELLO, "max_tokens": 1}

            async def fire() -> list[tuple[int, Any]]:
                connector = aiohttp.TCPConnector(limit=0)
                async with aiohttp.ClientSession(connector=connector) as session:
                    async def one(base: str) -> tuple[int, Any]:
                        async with session.post(
                            base + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {secret}"},
                        ) as r:
                            return r.status, await r.json()

                    return await asyncio.gather(*(one((a, b)[i % 2].base_url)
                                                  for i in range(total)))

            began = time.monotonic()
            results = asyncio.run(fire())
            elapsed = time.monotonic() - began
        admitted = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] != 200]
        # One bucket: at most its burst (the whole minute's limit) plus the refill since.
        assert rpm <= len(admitted) <= rpm + math.floor(rpm / 60 * elapsed), (
            f"{len(admitted)} admitted in {elapsed:.2f} s")
        assert all(status == 429 and raw["error"]["code"] == "rate_limit_exceeded"
                   for status, raw in refused), refused[:3]
    finally:
        if key_id:
            client = redis.Redis.from_url(redis_url)
            stale = list(client.scan_iter(match=f"{REDIS_PREFIX}key:{key_id}:*"))
            if stale:
                client.delete(*stale)
            client.close()
        shutil.rmtree(state, ignore_errors=True)


def test_an_idempotent_stream_that_failed_after_its_200_is_not_stored_for_replay() -> None:
    with _mock_replica() as replica, running_server("--replica-url", replica) as (server, _):
        url = server.base_url + "/v1/chat/completions"
        body = {"model": server.model, "messages": HELLO, "max_tokens": 4, "stream": True}
        headers = {**server.headers, "Idempotency-Key": f"idem-{uuid.uuid4().hex}"}

        async def main() -> list[tuple[int, Any, bytes]]:
            async with aiohttp.ClientSession() as session:
                results = []
                # The replica sends a first token, then fails; then it is healthy again.
                for failure_rate in (1.0, 0.0):
                    async with session.post(replica + "/mock/config",
                                            json={"inject_stream_error": failure_rate}) as r:
                        assert r.status == 200
                    async with session.post(url, json=body, headers=headers) as r:
                        results.append((r.status, r.headers, await r.read()))
                return results

        (status1, _, raw1), (status2, headers2, raw2) = asyncio.run(main())
    assert status1 == 200
    last = raw1.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b'data: {"error"'), raw1
    # The retry ran (a replay would repeat the error): a fresh, complete stream.
    assert status2 == 200 and "Idempotent-Replayed" not in headers2
    assert raw2.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw2


def test_the_body_cap_is_the_one_configured() -> None:
    env = {"TOKENYARD_MAX_BODY_BYTES": "4096"}
    with _mock_replica() as replica, \
            running_server("--replica-url", replica, env=env) as (server, _):
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                               max_retries=0)
        fits = [{"role": "user", "content": "x" * 3000}]
        assert client.chat.completions.create(model=server.model, messages=fits,
                                              max_tokens=1).choices
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": "x" * 5000}],
                max_tokens=1)
        assert refused.value.status_code == 413
        assert "4096 bytes" in refused.value.message
