"""A mock engine replica: tokenyard's replica protocol on a timer instead of a model.

It answers every route of `engine/protocol.py` the way `engine/server.py` does — info,
health, stats, generate (NDJSON per-step deltas), stop, abort — but makes its tokens up:
the first after `ttft_ms`, then one every `itl_ms`, `output_len` of them (capped by the
request's max_tokens; all max_tokens with ignore_eos). The ids cycle through `MOCK_TOKENS`,
ids of the embedded model's (SmolLM2) vocabulary that decode to an English sentence, so the
HTTP process in front detokenizes readable text.

For measuring a gateway against going direct, and as an external upstream, it also speaks
OpenAI's ``/v1/chat/completions`` and ``/v1/completions`` (streamed or not, usage with
``stream_options.include_usage``) and ``/v1/models`` with the same timing.

Failures are injected per request with probabilities: 429, 503 (overloaded, with
retry-after), 500 before the stream begins, and an error line after the first token.
``POST /mock/config`` changes timing and failure rates while it runs.

    python -m tokenyard.bench.mock_replica --port 0 --itl-ms 1 --output-len 16
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields

from aiohttp import web

from tokenyard.bench.mock_core import (
    MOCK_MODEL,
    MOCK_TOKENS,
    RATE_LIMITED,
    MockConfig,
    _json,
    _Run,
)
from tokenyard.bench.mock_openai import OpenAIRoutes
from tokenyard.wire.abort import decode_abort, decode_stop
from tokenyard.wire.outputs import EngineStats
from tokenyard.wire.protocol import (
    ABORT_PATH,
    ENGINE_ERROR,
    GENERATE_PATH,
    HEALTH_PATH,
    INFO_PATH,
    INVALID_REQUEST,
    NDJSON,
    OVERLOADED,
    STATS_PATH,
    STOP_PATH,
    CoreDelta,
    GenerateRequest,
    ProtocolError,
    encode_delta,
    encode_stream_error,
    error_body,
)
from tokenyard.wire.replica_info import ReplicaInfo
from tokenyard.wire.sampling_params import SamplingParamsError

#: Large enough that no tokenizer or prompt is refused for its size.
MOCK_VOCAB_SIZE = 262_144
MOCK_CONTEXT = 1_048_576
CONFIG_PATH = "/mock/config"
LISTEN_BACKLOG = 4096


class MockReplica(OpenAIRoutes):
    """The mock's routes over one `MockConfig` (replaceable while serving)."""

    def make_app(self) -> web.Application:
        """The aiohttp application with the replica routes and the OpenAI ones."""
        app = web.Application(client_max_size=16 * 2**20)
        app.router.add_post(GENERATE_PATH, self.generate)
        app.router.add_post(ABORT_PATH, self.abort)
        app.router.add_post(STOP_PATH, self.stop)
        app.router.add_get(STATS_PATH, self.stats)
        app.router.add_get(INFO_PATH, self.info)
        app.router.add_get(HEALTH_PATH, self.health)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post(CONFIG_PATH, self.set_config)
        return app

    # -- the replica protocol ----------------------------------------------------------------
    async def generate(self, http: web.Request) -> web.StreamResponse:
        """Stream one delta per token, as NDJSON lines; the last carries the finish reason."""
        try:
            wire = GenerateRequest.from_json(json.loads(await http.read()))
        except (ProtocolError, SamplingParamsError) as exc:
            return _json(error_body(str(exc), INVALID_REQUEST, exc.param), 400)
        except ValueError as exc:
            return _json(error_body(f"the body is not valid JSON: {exc}", INVALID_REQUEST), 400)
        status = self._injected_status()
        if status is not None:
            return _replica_failure(status)
        n, finish = self._length(wire.params.max_tokens, wire.params.ignore_eos)
        fail_after = max(1, n // 2) if self._fails_mid_stream() else None
        run = self.running[wire.request_id] = _Run()
        prompt_len = len(wire.prompt_token_ids)
        self.num_computed_tokens += prompt_len
        response = web.StreamResponse(headers={"Content-Type": NDJSON})
        try:
            await response.prepare(http)
            async for i in self._ticks(n, run):
                if i == fail_after:
                    break
                last = i == n - 1 and fail_after is None
                token = MOCK_TOKENS[i % len(MOCK_TOKENS)][0]
                # Like the engine, the first delta says how long it queued (never, here)
                # and prefilled (the configured time to first token).
                first = i == 0
                await response.write(encode_delta(CoreDelta(
                    wire.request_id, [token], None, finish if last else None, None,
                    prompt_len, 0, queue_time=0.0 if first else None,
                    prefill_time=self.config.ttft_ms / 1000.0 if first else None,
                )))
                self.num_computed_tokens += 1
            if fail_after is not None:
                await response.write(encode_stream_error("injected failure", ENGINE_ERROR))
            elif run.finish is not None:
                reason, stop_reason = run.finish
                await response.write(encode_delta(CoreDelta(
                    wire.request_id, [], None, reason, stop_reason, prompt_len, 0)))
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left
        finally:
            self.running.pop(wire.request_id, None)
        return response

    async def abort(self, http: web.Request) -> web.Response:
        """End a request's stream with finish_reason "abort" (unknown ids are ignored)."""
        try:
            request_id = decode_abort(json.loads(await http.read()))
        except (ProtocolError, ValueError) as exc:
            return _json(error_body(str(exc), INVALID_REQUEST), 400)
        run = self.running.get(request_id)
        if run is not None and run.finish is None:
            run.finish = ("abort", None)
        return _json({"ok": True})

    async def stop(self, http: web.Request) -> web.Response:
        """End a request's stream as stopped by stop string `stop`."""
        try:
            request_id, stop = decode_stop(json.loads(await http.read()))
        except (ProtocolError, ValueError) as exc:
            return _json(error_body(str(exc), INVALID_REQUEST), 400)
        run = self.running.get(request_id)
        if run is not None and run.finish is None:
            run.finish = ("stop", stop)
        return _json({"ok": True})

    async def stats(self, http: web.Request) -> web.Response:
        """`ReplicaStats`: requests running; the mock has no queue nor KV cache."""
        return _json(asdict(EngineStats(
            num_running=len(self.running), num_waiting=0, kv_cache_usage=0.0,
            num_kv_blocks=0, num_free_kv_blocks=0, prefix_cache_queries=0,
            prefix_cache_hits=0, num_preemptions=0,
            num_computed_tokens=self.num_computed_tokens,
        )))

    async def info(self, http: web.Request) -> web.Response:
        """Model "mock", with a vocabulary and a context window no request outgrows."""
        return _json(ReplicaInfo(
            model=MOCK_MODEL, max_model_len=MOCK_CONTEXT, vocab_size=MOCK_VOCAB_SIZE,
            eos_token_ids=[], block_size=16, num_kv_blocks=MOCK_CONTEXT // 16,
        ).to_json())

    async def health(self, http: web.Request) -> web.Response:
        """Always ready."""
        return _json({"status": "ok"})

    # -- control -----------------------------------------------------------------------------
    async def set_config(self, http: web.Request) -> web.Response:
        """``POST /mock/config`` with some `MockConfig` fields: change them; answer all."""
        try:
            changes = json.loads(await http.read())
            known = {f.name for f in fields(MockConfig)}
            unknown = sorted(set(changes) - known)
            if unknown:
                raise ValueError(f"unknown setting {unknown[0]!r}")
            self.config = dataclasses.replace(self.config, **changes)
        except (ValueError, TypeError, AttributeError) as exc:
            return _json(error_body(str(exc), INVALID_REQUEST), 400)
        return _json(asdict(self.config))


def _replica_failure(status: int) -> web.Response:
    """An injected failure in the replica protocol's shape."""
    if status == 503:
        return _json(error_body("injected overload", OVERLOADED), 503, {"Retry-After": "1"})
    code = RATE_LIMITED if status == 429 else ENGINE_ERROR
    return _json(error_body("injected failure", code), status)


async def run_mock(
    config: MockConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    seed: int = 0,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT; `port` 0 binds a free port, `on_ready` gets the URL."""
    runner = web.AppRunner(MockReplica(config, seed).make_app(), handler_cancellation=True,
                           access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        # A deep accept queue: under a burst of new connections, a full one drops SYNs and
        # the client waits a 1 s retransmit, which would be charged to what is measured.
        await web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG).start()
        bound = runner.addresses[0][1] if runner.addresses else port
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if on_ready is not None:
            on_ready(f"http://{host}:{bound}")
        await stop.wait()
    finally:
        await runner.cleanup()


def build_parser() -> argparse.ArgumentParser:
    """The mock's command line."""
    parser = argparse.ArgumentParser(prog="python -m tokenyard.bench.mock_replica",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001, help="0: any free port")
    add_mock_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the injected failures")
    return parser


def add_mock_arguments(parser: argparse.ArgumentParser) -> None:
    """The `MockConfig` flags (shared with `tokenyard bench gateway`)."""
    defaults = MockConfig()
    parser.add_argument("--output-len", type=int, default=defaults.output_len,
                        help="tokens per reply (the request's max_tokens caps it)")
    parser.add_argument("--ttft-ms", type=float, default=defaults.ttft_ms,
                        help="delay before the first token (ms)")
    parser.add_argument("--itl-ms", type=float, default=defaults.itl_ms,
                        help="delay between tokens (ms)")
    for name in ("429", "503", "500"):
        parser.add_argument(f"--inject-{name}", type=float, default=0.0, metavar="P",
                            help=f"probability that a request fails with {name}")
    parser.add_argument("--inject-stream-error", type=float, default=0.0, metavar="P",
                        help="probability that a stream fails after its first token")


def config_from_args(args: argparse.Namespace) -> MockConfig:
    """`MockConfig` from the flags of `add_mock_arguments`."""
    return MockConfig(
        output_len=args.output_len, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms,
        inject_429=args.inject_429, inject_503=args.inject_503, inject_500=args.inject_500,
        inject_stream_error=args.inject_stream_error,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the mock until SIGTERM; print ``... serving at URL`` once listening."""
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def ready(url: str) -> None:
        print(f"tokenyard mock replica serving at {url}\n", end="", flush=True)

    asyncio.run(run_mock(config, args.host, args.port, seed=args.seed, on_ready=ready))
    return 0


if __name__ == "__main__":
    sys.exit(main())
