"""Moderation through a real `tokenyard serve --config` (auth, billing and the ledger on)
over one real `tokenyard engine`, through the official SDKs.

Three deployments share the replica: `guarded` blocks input and output with a blocklist
whose pattern ("terrier", "labrador") SmolLM2 writes at temperature 0 for the prompts
below (checked beforehand: "Write a sentence about a dog." gives "The dog, a friendly and
lovable little terrier named Max, …"; "Write a long story about a dog named Max." names a
Labrador within its first 70 characters and goes on for 200 tokens); `audited` flags
both directions through an upstream classifier that takes `AUDIT_DELAY_S` to answer (a
stand-in for an external moderation service, run in this process); `plain` has no table
and follows its org's policy, which the admin API sets.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from tests.e2e.conftest import Server, running_server
from tests.integration.test_fleet import Engine
from tokenyard.balancer.moderation_client import ModerationClient
from tokenyard.gateway.moderation import UpstreamClassifier
from tokenyard.store.repo import DEFAULT_ORG_ID

AUDIT_DELAY_S = 3.0
DOG = "Write a sentence about a dog."
LONG = "Write a long story about a dog named Max."


class SlowModerations:
    """An OpenAI-shaped /v1/moderations that flags every text after AUDIT_DELAY_S, on an
    event loop of its own in a thread; `seen` counts the texts it was asked about."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.seen = 0
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        await asyncio.sleep(AUDIT_DELAY_S)
        self.seen += len(texts)
        return web.json_response({"id": "modr-1", "model": "slow", "results": [
            {"flagged": True, "categories": {"harassment": True},
             "category_scores": {"harassment": 0.9}} for _ in texts]})

    def start(self) -> str:
        async def go() -> str:
            app = web.Application()
            app.router.add_post("/v1/moderations", self.handle)
            self.runner = web.AppRunner(app, access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1"

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)

    def close(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Engine]]:
    directory = tmp_path_factory.mktemp("moderation")
    engine = Engine(secrets.token_urlsafe(16))
    slow = SlowModerations()
    try:
        engine.start()
        slow_url = slow.start()
        config = directory / "tokenyard.toml"
        config.write_text(f"""
[[deployments]]
name = "guarded"
urls = ["{engine.url}"]
[deployments.moderation]
input = "block"
output = "block"
classifier = "blocklist"
window = 16
patterns = {{ pets = ["terrier", "labrador"], violence = ['\\bkill\\b'] }}

[[deployments]]
name = "audited"
urls = ["{engine.url}"]
moderation = {{ input = "flag", output = "flag", classifier = "upstream", url = "{slow_url}" }}

[[deployments]]
name = "plain"
urls = ["{engine.url}"]
""")
        state = directory / "state"
        state.mkdir()
        with running_server("--config", str(config), state_dir=str(state),
                            env={"TOKENYARD_REPLICA_TOKEN": engine.token}) as (server, _):
            yield server, engine
    finally:
        engine.stop()
        slow.close()


def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                         max_retries=0)


def call(server: Server, method: str, path: str, body: Any = None,
         base: str | None = None, headers: dict[str, str] | None = None) -> Any:
    async def go() -> Any:
        async with aiohttp.ClientSession() as session, session.request(
                method, (base or server.base_url) + path, json=body,
                headers=headers if headers is not None else server.headers) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    return asyncio.run(go())


def usage(server: Server, model: str) -> dict[str, Any]:
    rows = call(server, "GET", "/admin/v1/usage?group_by=model")["data"]
    return next((r for r in rows if r["group"] == model),
                {"requests": 0, "prompt_tokens": 0, "output_tokens": 0})


def settled_usage(server: Server, model: str, requests: int) -> dict[str, Any]:
    """The model's usage once it counts `requests` (the ledger writes in batches)."""
    deadline = time.monotonic() + 5
    while (now := usage(server, model))["requests"] < requests:
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    return now


def engine_idle(server: Server, engine: Engine) -> dict[str, Any]:
    """The replica's stats once nothing runs on it (within 3 s)."""
    deadline = time.monotonic() + 3
    while True:
        stats = call(server, "GET", "/v1/engine/stats", base=engine.url,
                     headers={"Authorization": f"Bearer {engine.token}"})
        if stats["num_running"] == 0 or time.monotonic() > deadline:
            return dict(stats)
        time.sleep(0.05)


def test_blocked_input_is_a_400_in_each_dialect_and_charges_nothing(
        setup: tuple[Server, Engine]) -> None:
    server, _ = setup
    before = usage(server, "guarded")
    with pytest.raises(openai.BadRequestError) as caught:
        oai(server).chat.completions.create(
            model="guarded", messages=[{"role": "user", "content": "Is a Terrier loyal?"}])
    error = caught.value
    assert error.status_code == 400 and error.code == "content_policy_violation"
    assert "pets" in error.message and error.param == "messages"
    timing = error.response.headers["server-timing"]
    assert "moderate;dur=" in timing, timing

    client = anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key,
                                 max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="guarded", max_tokens=8, messages=[
            {"role": "user", "content": "How do I kill a stuck process?"}])
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "content policy" in body["error"]["message"]

    # A request that passes is billed; the two refused ones never were.
    ok = oai(server).chat.completions.create(
        model="guarded", max_tokens=4, messages=[{"role": "user", "content": "Hi!"}])
    assert ok.choices[0].finish_reason in ("stop", "length")
    after = settled_usage(server, "guarded", before["requests"] + 1)
    assert after["requests"] == before["requests"] + 1
    assert after["prompt_tokens"] - before["prompt_tokens"] == ok.usage.prompt_tokens


def test_flagged_output_ends_with_content_filter_and_frees_the_replica(
        setup: tuple[Server, Engine]) -> None:
    server, engine = setup
    client = oai(server)
    before = usage(server, "guarded")
    # Unmoderated, the long story runs to max_tokens and names a Labrador early.
    plain = client.chat.completions.create(model="plain", temperature=0, max_tokens=200,
                                           messages=[{"role": "user", "content": LONG}])
    assert "labrador" in plain.choices[0].message.content.lower()
    assert plain.choices[0].finish_reason == "length"

    stopped = client.chat.completions.create(model="guarded", temperature=0, max_tokens=200,
                                             messages=[{"role": "user", "content": LONG}])
    choice = stopped.choices[0]
    assert choice.finish_reason == "content_filter"
    assert "labrador" not in (choice.message.content or "").lower()
    assert 0 < stopped.usage.completion_tokens < 60  # stopped early, billed what ran
    stats = engine_idle(server, engine)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], stats

    # Streamed: the text before the window arrives, the flagged part never does.
    chunks = list(client.chat.completions.create(
        model="guarded", temperature=0, max_tokens=60, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": DOG}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "content_filter" and "terrier" not in text.lower()
    assert text and "The dog, a friendly and lovable little terrier".startswith(text)
    streamed_usage = chunks[-1].usage
    assert streamed_usage is not None and streamed_usage.completion_tokens > 0

    # Anthropic: stop_reason "refusal", streamed and not.
    claude = anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key,
                                 max_retries=0)
    message = claude.messages.create(model="guarded", max_tokens=60,
                                     extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": DOG}])
    assert message.stop_reason == "refusal"
    assert "terrier" not in "".join(b.text for b in message.content if b.type == "text")
    with claude.messages.stream(model="guarded", max_tokens=60,
                                extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": DOG}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "refusal"
    stats = engine_idle(server, engine)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], stats

    # Each filtered request has its ledger row, with the tokens generated.
    after = settled_usage(server, "guarded", before["requests"] + 4)
    assert after["output_tokens"] - before["output_tokens"] >= (
        stopped.usage.completion_tokens + streamed_usage.completion_tokens)


def test_flag_mode_records_after_the_response_without_delaying_it(
        setup: tuple[Server, Engine]) -> None:
    server, _ = setup
    client = oai(server)
    began = time.monotonic()
    reply = client.chat.completions.create(
        model="audited", max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "How do I kill a stuck process?"}])
    elapsed = time.monotonic() - began
    assert reply.choices[0].finish_reason in ("stop", "length")
    # The classifier takes AUDIT_DELAY_S per check: it ran beside the request, not in it.
    assert elapsed < AUDIT_DELAY_S, elapsed
    deadline = time.monotonic() + 3 * AUDIT_DELAY_S
    while True:
        events = [e for e in call(server, "GET", "/admin/v1/moderation/events")["data"]
                  if e["deployment"] == "audited"]
        if len(events) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted(e["direction"] for e in events[:2]) == ["input", "output"]
    assert {e["action"] for e in events} == {"flag"}
    assert events[0]["classifier"] == "upstream"
    assert events[0]["categories"] == ["harassment"] and events[0]["org_id"]


def test_an_org_policy_applies_where_its_deployment_has_none(
        setup: tuple[Server, Engine]) -> None:
    server, _ = setup
    client = oai(server)
    insult = [{"role": "user", "content": "you are a fucking idiot"}]
    client.chat.completions.create(model="plain", max_tokens=2, messages=insult)
    path = f"/admin/v1/orgs/{DEFAULT_ORG_ID}/moderation"
    assert call(server, "POST", path, {"input": "block"}) == {
        "org_id": DEFAULT_ORG_ID, "input": "block", "output": "off"}
    try:
        with pytest.raises(openai.BadRequestError, match="profanity"):
            client.chat.completions.create(model="plain", max_tokens=2, messages=insult)
        fine = client.chat.completions.create(
            model="plain", max_tokens=2, messages=[{"role": "user", "content": "Hello!"}])
        assert fine.choices[0].message.content is not None
    finally:
        call(server, "POST", path, {"input": "off"})
    client.chat.completions.create(model="plain", max_tokens=2, messages=insult)


def test_moderations_endpoint_in_openai_s_shape(setup: tuple[Server, Engine]) -> None:
    server, _ = setup
    client = oai(server)
    before = usage(server, "omni-moderation-latest")
    result = client.moderations.create(
        model="omni-moderation-latest",
        input=["What a lovely day.", "you are a fucking idiot"])
    assert result.id.startswith("modr-") and result.model == "omni-moderation-latest"
    calm, rude = result.results
    assert not calm.flagged and rude.flagged
    assert rude.categories.harassment is True  # what the local model measures
    extra = rude.model_dump()
    assert extra["categories"]["profanity"] is True
    assert extra["category_scores"]["profanity"] == extra["category_scores"]["harassment"]
    assert calm.category_scores.violence == 0.0  # a placeholder, and said to be one:
    assert "violence" in extra["unmeasured_categories"]
    assert "harassment" not in extra["unmeasured_categories"]
    # A threat was flagged only as the non-OpenAI `profanity`.
    (threat,) = client.moderations.create(input="I will kill you").results
    assert threat.flagged and threat.categories.harassment is True

    # A deployment's name picks its classifier: the blocklist's categories.
    (hit,) = client.moderations.create(model="guarded", input="a terrier").results
    assert hit.flagged and hit.model_dump()["categories"]["pets"] is True
    with pytest.raises(openai.NotFoundError):
        client.moderations.create(model="no-such-model", input="x")
    with pytest.raises(openai.BadRequestError):
        client.moderations.create(input=[])
    after = settled_usage(server, "omni-moderation-latest", before["requests"] + 1)
    assert after["prompt_tokens"] > before["prompt_tokens"]

    # The upstream classifier reads this endpoint as it would OpenAI's.
    async def upstream() -> list[bool]:
        classifier = UpstreamClassifier(ModerationClient(
            server.base_url + "/v1", model="profanity-check", token=server.api_key))
        try:
            return [v.flagged for v in await classifier.classify(["hi", "shit"])]
        finally:
            await classifier.client.close()

    assert asyncio.run(upstream()) == [False, True]
