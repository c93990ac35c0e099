"""The embeddings replica as an HTTP server (`tokenyard embed`): token ids or texts in, one
vector per input out, through the dynamic batcher. The wire format is `wire/embeddings.py`.

Like the engine replica (`engine/server.py`, whose token check and exposure rule it
shares): every route but health needs ``Authorization: Bearer <token>`` when
TOKENYARD_REPLICA_TOKEN is set; SIGTERM drains (new requests get 503 ``draining``, the
running ones finish within `drain_timeout`) and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
from aiohttp import web
from aiohttp.typedefs import Handler

from tokenyard.engine.embed.batcher import DynamicBatcher, QueueFull
from tokenyard.engine.embed.model import LoadedEncoder, load_encoder
from tokenyard.engine.replica_access import bearer_matches, check_exposure
from tokenyard.engine.server import UNAUTHORIZED
from tokenyard.wire.embeddings import (
    EMBED_INFO_PATH,
    EMBED_PATH,
    EMBED_STATS_PATH,
    EMBED_TOKENIZER_PATH,
    EmbeddingsInfo,
    EmbedRequest,
    EmbedResult,
    pack_floats,
)
from tokenyard.wire.protocol import (
    CONTEXT_LENGTH_EXCEEDED,
    DRAINING,
    ENGINE_ERROR,
    HEALTH_PATH,
    INVALID_REQUEST,
    OVERLOADED,
    dumps,
    error_body,
)

log = logging.getLogger("tokenyard.engine")

#: 2,048 inputs of 256 token ids is about 3 MiB of JSON.
MAX_BODY_BYTES = 16 * 2**20


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json",
                        headers=headers)


def _bad_request(message: str, param: str | None, code: str = INVALID_REQUEST) -> web.Response:
    return _json(error_body(message, code, param), status=400)


def make_encode(loaded: LoadedEncoder) -> Callable[[list[list[int]]], list[bytes]]:
    """The batcher's `encode`: token-id lists → each input's vector as little-endian
    float32 bytes (run in the batcher's thread)."""

    def encode(inputs: list[list[int]]) -> list[bytes]:
        vectors = loaded.encoder.embed(inputs).numpy().astype("<f4", copy=False)
        return [row.tobytes() for row in vectors]

    return encode


class EmbeddingsServer:
    """The replica's routes over one encoder and its batcher, and the drain on shutdown."""

    def __init__(
        self, loaded: LoadedEncoder, batcher: DynamicBatcher, *, token: str | None = None,
        drain_timeout: float = 30.0, retry_after_s: int = 1,
    ) -> None:
        self.loaded = loaded
        self.batcher = batcher
        self.token = token
        self.drain_timeout = drain_timeout
        self.retry_after_s = retry_after_s
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        cfg = loaded.config
        self.info_body = EmbeddingsInfo(
            model=loaded.name, dimensions=cfg.hidden_size, max_tokens=cfg.max_tokens,
            vocab_size=cfg.vocab_size, max_batch_inputs=batcher.max_batch_inputs,
        ).to_json()
        self.tokenizer_json = loaded.tokenizer.to_str()

    def make_app(self) -> web.Application:
        """The aiohttp application with every route of the embeddings replica."""
        middlewares = [self._check_token] if self.token is not None else []
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        app.router.add_post(EMBED_PATH, self.embed)
        app.router.add_get(EMBED_INFO_PATH, self.info)
        app.router.add_get(EMBED_STATS_PATH, self.stats)
        app.router.add_get(EMBED_TOKENIZER_PATH, self.tokenizer)
        app.router.add_get(HEALTH_PATH, self.health)
        return app

    @web.middleware
    async def _check_token(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Middleware: 401 for a call without the replica's token (health needs none)."""
        if request.path == HEALTH_PATH or bearer_matches(
            request.headers.get("Authorization"), self.token or ""
        ):
            return await handler(request)
        return _json(error_body("this replica needs its token: Authorization: Bearer "
                                "<TOKENYARD_REPLICA_TOKEN>", UNAUTHORIZED),
                     status=401, headers={"WWW-Authenticate": "Bearer"})

    async def embed(self, http: web.Request) -> web.Response:
        """Embed a request's inputs in the next batched forward pass(es)."""
        if self.draining or not self.batcher.is_running:
            return self._unavailable(DRAINING, "the replica is shutting down")
        try:
            wire = EmbedRequest.from_json(json.loads(await http.read()))
        except (ValueError, UnicodeDecodeError) as exc:  # ProtocolError is a ValueError
            return _bad_request(f"invalid request: {exc}", getattr(exc, "param", None))
        if isinstance(wire.inputs[0], str):
            param = "texts"
            encodings = self.loaded.tokenizer.encode_batch(wire.inputs)
            inputs = [enc.ids for enc in encodings]
        else:
            param, inputs = "input_ids", wire.inputs
        refusal = self._check(inputs, param)
        if refusal is not None:
            return refusal
        self._in_flight += 1
        self._idle.clear()
        try:
            done = await self.batcher.embed(inputs)
        except QueueFull as exc:
            return self._unavailable(OVERLOADED, str(exc))
        except Exception as exc:  # the forward pass failed
            return _json(error_body(f"embedding failed: {exc}", ENGINE_ERROR), status=500)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()
        result = EmbedResult([pack_floats(v) for v in done.vectors], [len(i) for i in inputs],
                             queue_ms=done.queue_ns / 1e6, forward_ms=done.forward_ns / 1e6)
        return _json(result.to_json())

    def _check(self, inputs: list[list[int]], param: str) -> web.Response | None:
        """400 for an input longer than the model takes, or with an id outside the
        vocabulary (it would fail the whole batched pass, not just this request)."""
        cfg = self.loaded.config
        for i, ids in enumerate(inputs):
            if len(ids) > cfg.max_tokens:
                return _bad_request(
                    f"input {i} has {len(ids)} tokens; this model takes at most "
                    f"{cfg.max_tokens}", f"{param}.{i}", CONTEXT_LENGTH_EXCEEDED)
            if any(not 0 <= t < cfg.vocab_size for t in ids):
                return _bad_request(f"token ids must be in [0, {cfg.vocab_size})",
                                    f"{param}.{i}")
        return None

    async def info(self, http: web.Request) -> web.Response:
        """The served model (`EmbeddingsInfo`)."""
        return _json(self.info_body)

    async def stats(self, http: web.Request) -> web.Response:
        """The batcher's counters (`EmbedStats`)."""
        return _json(self.batcher.stats.to_json())

    async def tokenizer(self, http: web.Request) -> web.Response:
        """The tokenizer.json the replica tokenizes with (truncation and padding off)."""
        return web.Response(text=self.tokenizer_json, content_type="application/json")

    async def health(self, http: web.Request) -> web.Response:
        """200 while admitting; 503 while draining or if the batcher died."""
        if not self.batcher.is_running:
            return _json({"status": "dead"}, status=503)
        if self.draining:
            return _json({"status": "draining"}, status=503)
        return _json({"status": "ok"})

    async def drain(self) -> None:
        """Refuse new requests and let the running ones finish (at most drain_timeout)."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), self.drain_timeout)

    def _unavailable(self, code: str, message: str) -> web.Response:
        return _json(error_body(message, code), status=503,
                     headers={"Retry-After": str(self.retry_after_s)})


async def run_embeddings_server(
    server: EmbeddingsServer, host: str, port: int,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then drain and return. `port` 0 binds a free port;
    `on_ready` receives the URL actually served."""
    server.batcher.start()
    runner = web.AppRunner(server.make_app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1] if runner.addresses else port
        shown = f"[{host}]" if ":" in host else host
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if on_ready is not None:
            on_ready(f"http://{shown}:{bound}")
        await stop.wait()
        await server.drain()
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
        await server.batcher.stop()


def serve_embeddings(
    host: str = "127.0.0.1",
    port: int = 8002,
    *,
    model: str | None = None,
    threads: int | None = None,
    max_batch_inputs: int = 64,
    max_batch_tokens: int = 8192,
    max_waiting_inputs: int = 4096,
    drain_timeout: float = 30.0,
    token: str | None = None,
) -> int:
    """Load the encoder (`model`: a sentence-transformers folder; None: the embedded
    all-MiniLM-L6-v2), serve it until SIGTERM, drain, and return 0. `threads`: torch's
    intra-op threads (None: torch's default)."""
    check_exposure(host, token)  # before the model loads: a refusal should be quick
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    loaded = load_encoder(model)
    if max_batch_tokens < loaded.config.max_tokens:
        raise ValueError(f"--max-batch-tokens must hold one whole input "
                         f"({loaded.config.max_tokens} tokens)")
    batcher = DynamicBatcher(make_encode(loaded), max_batch_inputs=max_batch_inputs,
                             max_batch_tokens=max_batch_tokens,
                             max_waiting_inputs=max_waiting_inputs)
    server = EmbeddingsServer(loaded, batcher, token=token, drain_timeout=drain_timeout)
    # On stderr: stdout's one line is the ready mark that `tokenyard serve` waits for.
    took = round(time.perf_counter() - started, 1)
    log.info("tokenyard embed: %s loaded in %.1f s (%d threads)", loaded.name, took,
             torch.get_num_threads(), extra={"event": "model_loaded", "model": loaded.name,
                                             "seconds": took})

    def ready(url: str) -> None:
        # One write, newline included: the log thread writes to the same pipe, and a
        # line of its between the mark and its newline broke the parent's parse of the URL.
        print(f"tokenyard embed: {loaded.name} serving at {url}\n", end="", flush=True)

    asyncio.run(run_embeddings_server(server, host, port, on_ready=ready))
    return 0
