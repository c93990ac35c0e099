"""An engine replica as an HTTP server: token ids in, one NDJSON line per engine step out.

The wire format is `engine/protocol.py`. aiohttp rather than starlette + uvicorn: it costs
less CPU per request and per streamed line, and the replica's CPU belongs to the model.

- A client that disconnects mid-stream cancels its handler (aiohttp's
  `handler_cancellation`), which closes the request's CoreStream: the request is aborted
  and its KV blocks freed before the next engine step.
- Every route but health needs ``Authorization: Bearer <token>`` when the replica has a
  token (`TOKENYARD_REPLICA_TOKEN`): the body names the prefix-cache salt (the tenant) and
  the priority, which only the gateway may choose. Without a token the replica serves only
  on a loopback address (with a warning); a wider bind without one is refused.
- SIGTERM (or SIGINT) drains: new requests get 503 ``draining``, in-flight ones run to
  their end for up to `drain_timeout` seconds, then whatever is left is aborted (its
  stream ends with finish_reason "abort") and the process exits 0. A second signal
  skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import asdict
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from tokenyard.engine.async_core import AsyncEngineCore
from tokenyard.engine.frontend import make_request
from tokenyard.engine.kv_events import KVEventPublisher
from tokenyard.engine.lora.adapter import AdapterError
from tokenyard.engine.mux_server import serve_mux
from tokenyard.engine.refusal import Refused, json_answer
from tokenyard.engine.replica_access import bearer_matches
from tokenyard.engine.replica_spans import ReplicaSpans
from tokenyard.engine.request import Request
from tokenyard.engine.sample.grammar import GrammarError, GuidedState
from tokenyard.engine.scheduler import QueueFullError
from tokenyard.telemetry.metrics import render_replica_metrics
from tokenyard.wire.abort import abort_answer, decode_abort, decode_stop
from tokenyard.wire.mux import MUX_PATH
from tokenyard.wire.protocol import (
    ABORT_PATH,
    CONTEXT_LENGTH_EXCEEDED,
    DRAINING,
    GENERATE_PATH,
    HEALTH_PATH,
    INFO_PATH,
    INVALID_REQUEST,
    LORAS_PATH,
    NDJSON,
    OVERLOADED,
    STATS_PATH,
    STOP_PATH,
    GenerateRequest,
    ProtocolError,
    encode_delta,
    encode_stream_error,
    error_body,
)
from tokenyard.wire.replica_info import ReplicaInfo
from tokenyard.wire.sampling_params import SamplingParamsError

log = logging.getLogger("tokenyard.engine")

# A 128k-token prompt is about 1 MiB of JSON; aiohttp's default body cap is 1 MiB.
MAX_BODY_BYTES = 16 * 2**20
#: How long an abort's answer waits for the step thread to run it (and report).
ABORT_REPORT_WAIT_S = 5.0
#: The error code of a call without the replica's token (401).
UNAUTHORIZED = "unauthorized"


class _BadRequest(Refused):
    def __init__(self, message: str, param: str | None, code: str = INVALID_REQUEST) -> None:
        super().__init__(400, message, code, param)


class ReplicaServer:
    """The replica's HTTP routes over one AsyncEngineCore, and its drain on shutdown."""

    def __init__(
        self,
        engine: AsyncEngineCore,
        *,
        drain_timeout: float = 30.0,
        retry_after_s: int = 1,
        token: str | None = None,
    ) -> None:
        """`token`: the bearer token every route but health requires (None: none)."""
        self.engine = engine
        self.token = token
        self.drain_timeout = drain_timeout
        self.retry_after_s = retry_after_s
        self.draining = False
        self._in_flight: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._force = asyncio.Event()
        #: Its KV-event publisher, when it publishes (`run_server`).
        self.kv_events: KVEventPublisher | None = None
        self.vllm_kv_events: KVEventPublisher | None = None

    def make_app(self) -> web.Application:
        """The aiohttp application with every replica route."""
        middlewares = [self._check_token] if self.token is not None else []
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        app.router.add_post(GENERATE_PATH, self.generate)
        app.router.add_get(MUX_PATH, self.mux)
        app.router.add_post(ABORT_PATH, self.abort)
        app.router.add_post(STOP_PATH, self.stop)
        app.router.add_get(STATS_PATH, self.stats)
        app.router.add_get(INFO_PATH, self.info)
        app.router.add_post(LORAS_PATH, self.load_lora)
        app.router.add_delete(LORAS_PATH + "/{name}", self.unload_lora)
        app.router.add_get(HEALTH_PATH, self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @web.middleware
    async def _check_token(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Middleware: 401 for a call without the replica's token (health needs none)."""
        if request.path == HEALTH_PATH or bearer_matches(
            request.headers.get("Authorization"), self.token or ""
        ):
            return await handler(request)
        return json_answer(
            error_body("this replica needs its token: Authorization: Bearer "
                       "<TOKENYARD_REPLICA_TOKEN>", UNAUTHORIZED),
            status=401, headers={"WWW-Authenticate": "Bearer"},
        )

    # -- routes --------------------------------------------------------------------------
    async def generate(self, http: web.Request) -> web.StreamResponse:
        """Admit a request, then stream its per-step deltas until it finishes."""
        try:
            request = await self.prepare(await _read_json(http))
            stream = await self.start(request)
        except Refused as refused:
            return refused.response()
        spans = ReplicaSpans.start(http.headers, request.request_id)  # None unless traced
        error: str | None = None
        try:
            response = web.StreamResponse(headers={"Content-Type": NDJSON})
            try:
                await response.prepare(http)
                async for batch in stream:
                    batch += stream.ready()  # steps that arrived meanwhile: one write
                    if spans is not None:
                        spans.saw(batch)
                    await response.write(b"".join(encode_delta(out) for out in batch))
                await response.write_eof()
            except ConnectionResetError:
                pass  # the client left; `finally` aborts the request
            except Exception as exc:  # the engine failed this request after it began
                error = f"engine step failed: {exc}"
                with contextlib.suppress(ConnectionResetError):
                    await response.write(encode_stream_error(error))
                    await response.write_eof()
            return response
        finally:
            if spans is not None:
                spans.export(error)
            # Also reached on cancellation (the client disconnected): abort what is left.
            stream.close()
            self.ended(request.request_id)

    async def mux(self, http: web.Request) -> web.WebSocketResponse:
        """The multiplexed channel: every request of one gateway (`engine/mux_server.py`)."""
        return await serve_mux(self, http)

    async def prepare(self, body: Any) -> Request:
        """A generate body checked and made a core request (its grammar compiled); raises
        Refused (400, or 503 while draining)."""
        if self.draining or not self.engine.is_running:
            raise self._unavailable(DRAINING, "the replica is shutting down")
        try:
            wire = GenerateRequest.from_json(body)
            self._check_fits(wire)
        except (ProtocolError, SamplingParamsError) as exc:
            raise _BadRequest(str(exc), exc.param) from None
        request = make_request(
            wire.request_id, wire.prompt_token_ids, wire.params, self.engine.eos_token_ids,
            cache_salt=wire.cache_salt, priority=wire.priority, lora=wire.lora,
        )
        request.pins = tuple(wire.pins)
        if wire.params.guided is not None:
            # Compiled on the grammar thread (cached); an invalid grammar is a 400 here.
            try:
                request.guided = await self._guided_state(request)
            except GrammarError as exc:
                raise _BadRequest(str(exc), exc.param) from None
        return request

    async def start(self, request: Request, into: Any = None) -> Any:
        """Submit a prepared request (into a CoreChannel, or a stream of its own, which is
        returned); it counts as in flight until `ended`. Refused: 503 overloaded, 400."""
        request_id = request.request_id
        added = request_id not in self._in_flight
        self._in_flight.add(request_id)
        self._idle.clear()
        try:
            return await self.engine.submit([request], into)
        except BaseException as exc:
            if added:
                self.ended(request_id)
            if isinstance(exc, QueueFullError):
                raise self._unavailable(OVERLOADED, str(exc)) from None
            if isinstance(exc, ValueError):  # larger than the KV pool, a duplicate id
                raise _BadRequest(str(exc), None) from None
            raise

    def ended(self, request_id: str) -> None:
        """A request's stream ended: it no longer counts as in flight."""
        self._in_flight.discard(request_id)
        if not self._in_flight:
            self._idle.set()

    async def _guided_state(self, request: Request) -> GuidedState:
        """`request`'s grammar state once compiled (GrammarError if the grammar is invalid)."""
        grammars, guided = self.engine.core.grammars, request.params.guided
        if grammars is None or guided is None:
            raise GrammarError("guided", "this replica cannot run constrained decoding")
        state = grammars.state(guided, request.eos_token_ids)  # thread-safe
        with contextlib.suppress(Exception):  # a failure is read back as `state.error`
            await asyncio.wrap_future(state.future)
        if (error := state.error) is not None:
            raise error
        return state

    async def abort(self, http: web.Request) -> web.Response:
        """Abort a request; its stream ends with finish_reason "abort". The answer carries
        what the request had computed (`AbortReport`) once the step thread ran the abort,
        at most `ABORT_REPORT_WAIT_S` later (a step in progress finishes first); past
        that, or for a request this replica no longer holds, the answer is ok alone."""
        try:
            request_id = decode_abort(await _read_json(http))
        except (_BadRequest, ProtocolError) as exc:
            return json_answer(error_body(str(exc), INVALID_REQUEST, exc.param), status=400)
        report = None
        if not self.engine.is_running:  # nothing runs, and no step thread would answer
            return json_answer(abort_answer(None))
        with contextlib.suppress(TimeoutError):  # the abort itself still runs
            report = await asyncio.wait_for(self.engine.abort_report(request_id),
                                            ABORT_REPORT_WAIT_S)
        return json_answer(abort_answer(report))

    async def stop(self, http: web.Request) -> web.Response:
        """The HTTP side matched a stop string: finish the request as stopped."""
        try:
            request_id, stop = decode_stop(await _read_json(http))
        except (_BadRequest, ProtocolError) as exc:
            return json_answer(error_body(str(exc), INVALID_REQUEST, exc.param), status=400)
        self.engine.finish_with_stop_string(request_id, stop)
        return json_answer({"ok": True})

    async def stats(self, http: web.Request) -> web.Response:
        """The engine's counters (`ReplicaStats` on the wire)."""
        return json_answer(asdict(self.engine.stats()))

    async def metrics(self, http: web.Request) -> web.Response:
        """Prometheus text: the engine's figures, also under vLLM's names (for routers
        built for vLLM); behind the token like every route but health."""
        text = render_replica_metrics(self.engine.stats(), self.engine.model_name)
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def load_lora(self, http: web.Request) -> web.Response:
        """Serve a LoRA adapter ({"name", "path"}: a PEFT folder on this host) from now
        on, replacing one of that name; 400 naming what is wrong. Read in a thread."""
        try:
            body = await _read_json(http)
        except _BadRequest as exc:
            return json_answer(error_body(str(exc), INVALID_REQUEST), status=400)
        name = body.get("name") if isinstance(body, dict) else None
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(name, str) or not isinstance(path, str):
            return json_answer(error_body("give the adapter's name and path (strings)",
                                          INVALID_REQUEST), status=400)
        loras = self.engine.core.loras
        try:
            await asyncio.to_thread(loras.register, name, path)
        except AdapterError as exc:
            return json_answer(error_body(str(exc), INVALID_REQUEST, "path"), status=400)
        return json_answer({"loras": sorted(loras.adapters)})

    async def unload_lora(self, http: web.Request) -> web.Response:
        """Stop serving an adapter (requests holding it finish with it); 400 if unknown."""
        loras = self.engine.core.loras
        name = http.match_info["name"]
        if not loras.unregister(name):
            return json_answer(error_body(f"no LoRA adapter {name!r} is served here",
                                          INVALID_REQUEST, "name"), status=400)
        return json_answer({"loras": sorted(loras.adapters)})

    async def info(self, http: web.Request) -> web.Response:
        """What the HTTP side needs to know of this replica's model."""
        core = self.engine.core
        info = ReplicaInfo(
            model=self.engine.model_name,
            max_model_len=core.max_model_len,
            vocab_size=self.engine.model_config.vocab_size,
            eos_token_ids=sorted(self.engine.eos_token_ids),
            block_size=core.kv.block_size,
            num_kv_blocks=core.kv.num_blocks,
            weights=self.engine.weights,
            loras=sorted(core.loras.adapters),
        )
        if self.kv_events is not None:
            info.kv_events_endpoint = self.kv_events.endpoint
            info.kv_events_replay_endpoint = self.kv_events.replay_endpoint
        if self.vllm_kv_events is not None:
            info.vllm_kv_events_endpoint = self.vllm_kv_events.endpoint
        return json_answer(info.to_json())

    async def health(self, http: web.Request) -> web.Response:
        """200 while admitting; 503 while draining or if the step loop died."""
        if not self.engine.is_running:
            return json_answer({"status": "dead"}, status=503)
        if self.draining:
            return json_answer({"status": "draining"}, status=503)
        return json_answer({"status": "ok"})

    # -- shutdown ------------------------------------------------------------------------
    def request_shutdown(self) -> None:
        """Begin draining; called again, stop waiting for in-flight requests."""
        if self.draining:
            self._force.set()
        self.draining = True

    async def drain(self) -> None:
        """Refuse new requests; wait for in-flight ones (bounded), then abort the rest."""
        self.draining = True
        if self._in_flight:
            log.info("tokenyard engine: draining %d requests (up to %g s)",
                     len(self._in_flight), self.drain_timeout,
                     extra={"event": "replica_draining", "requests": len(self._in_flight),
                            "timeout_s": self.drain_timeout})
            await _first_of(self._idle.wait(), self._force.wait(), timeout=self.drain_timeout)
        if self._in_flight:
            for request_id in list(self._in_flight):
                self.engine.abort(request_id)
            # Their streams now end with an "abort" line; let the handlers write it.
            await _first_of(self._idle.wait(), timeout=5.0)

    # -- helpers -------------------------------------------------------------------------
    def _check_fits(self, wire: GenerateRequest) -> None:
        n, window = len(wire.prompt_token_ids), self.engine.max_model_len
        if n >= window:
            raise _BadRequest(
                f"the prompt has {n} tokens; this model's context window is {window} tokens "
                f"(the prompt must be shorter, to leave room for output)",
                "prompt_token_ids", CONTEXT_LENGTH_EXCEEDED,
            )
        # An id past the embedding table would fail the whole batched step, not just this
        # request: refuse it here.
        vocab = self.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in wire.prompt_token_ids):
            raise _BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt_token_ids")
        if any(not 0 <= t < vocab for t in wire.params.logit_bias or {}):
            raise _BadRequest(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")

    def _unavailable(self, code: str, message: str) -> Refused:
        return Refused(503, message, code, retry_after=self.retry_after_s)


async def _read_json(http: web.Request) -> Any:
    try:
        return json.loads(await http.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadRequest(f"the body is not valid JSON: {exc}", None) from exc


async def _first_of(*waits: Any, timeout: float) -> None:
    """Wait until the first of some coroutines is done, at most `timeout` seconds."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
