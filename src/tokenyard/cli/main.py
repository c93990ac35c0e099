"""The `tokenyard` command."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenyard.cli.embed import add_embed_parser, embed_kwargs
from tokenyard.cli.processes import end_process
from tokenyard.config import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ServeConfig,
    replica_token,
)
from tokenyard.deployments import DEFAULT_MAX_OUTPUT_TOKENS, POLICIES
from tokenyard.engine_args import add_engine_args, engine_kwargs


def _engine(args: argparse.Namespace) -> int:
    from tokenyard.engine.replica_process import serve_engine
    from tokenyard.telemetry import logs

    logs.configure()  # the format `serve` put in the environment, else by the terminal
    return serve_engine(
        args.host, args.port, drain_timeout=args.drain_timeout, token=replica_token(),
        show_progress=logs.active_format == "text", **engine_kwargs(args),
    )


def _embed(args: argparse.Namespace) -> int:
    from tokenyard.engine.embed.server import serve_embeddings
    from tokenyard.telemetry import logs

    logs.configure()
    return serve_embeddings(token=replica_token(), **embed_kwargs(args))


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """`serve`'s settings: defaults < TOKENYARD_* environment < its flags."""
    return ServeConfig.from_env(drain_timeout_s=args.drain_timeout, workers=args.workers,
                                tls_cert=args.tls_cert, tls_key=args.tls_key,
                                responses_retention_days=args.responses_retention_days,
                                request_records_retention_hours=args.records_retention,
                                edge_connections_per_address=args.edge_connections,
                                edge_requests_per_s=args.edge_rate,
                                header_timeout_s=args.header_timeout,
                                max_header_bytes=args.max_header_bytes,
                                stream_write_timeout_s=args.stream_write_timeout,
                                redact_patterns=tuple(args.redact_pattern or ()) or None,
                                region=args.region,
                                batch_concurrency=args.batch_concurrency,
                                batch_lease_s=args.batch_lease,
                                batch_enqueued_tokens=args.batch_enqueued_tokens)


def _serve(args: argparse.Namespace) -> int:
    from tokenyard.cli.serve import serve

    config = serve_config(args)
    config.ssl_context()  # a bad certificate or key fails now, before any replica starts

    # The replica child gets the same engine flags back, spelled as its parser wants them.
    flags = {"num_threads": "--threads"}
    engine_args: list[str] = []
    for name, value in engine_kwargs(args).items():
        engine_args += [flags.get(name, "--" + name.replace("_", "-")), str(value)]
    try:
        return serve(
            args.host, args.port, engine_args, model=args.model, config=config,
            replica_url=args.replica_url, auth=args.auth, fleet_file=args.config,
            replicas=args.replicas, embeddings=args.embeddings, policy=args.policy,
            queue_timeout_s=args.queue_timeout, log_format=args.log_format,
            log_level=args.log_level, max_output_tokens=args.max_output_tokens,
            parsers=(args.tool_call_parser, args.reasoning_parser),
        )
    except (RuntimeError, OSError) as exc:  # the replica failed to start, port in use, ...
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _bench(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        from tokenyard.bench.serve import main as serve_main

        return serve_main(args)
    if args.bench_command == "suite":
        from tokenyard.bench.suite import main as suite_main

        return suite_main(args)
    if args.bench_command == "gateway":
        from tokenyard.bench.gateway import main as gateway_main

        return gateway_main(args)
    if args.bench_command == "fleet":
        from tokenyard.bench.fleet import main as fleet_main

        return fleet_main(args)
    if args.bench_command == "micro":
        from tokenyard.bench.micro import main as micro_main

        return micro_main(args)
    if args.bench_command == "peers":
        from tokenyard.bench.peers import main as peers_main

        return peers_main(args)
    if args.bench_command == "profile":
        from tokenyard.bench.profile import main as profile_main

        return profile_main(args)
    if args.bench_command == "grammar":
        from tokenyard.bench.grammar import main as grammar_main

        return grammar_main(args)
    if args.bench_command == "batch":
        from tokenyard.bench.batch import main as batch_main

        return batch_main(args)
    if args.bench_command == "spec":
        from tokenyard.bench.spec import main as spec_main

        return spec_main(args)
    if args.bench_command == "lora":
        from tokenyard.bench.lora import main as lora_main

        return lora_main(args)
    if args.bench_command == "host":
        from tokenyard.bench.host_path import main as host_main

        return host_main(args)
    if args.bench_command == "agent":
        from tokenyard.bench.agent import main as agent_main

        return agent_main(args)
    if args.bench_command == "models":
        from tokenyard.bench.models import main as models_main

        return models_main(args)
    if args.bench_command == "ray":
        from tokenyard.cli.ray_bench import main as ray_bench_main

        return ray_bench_main(args)
    from tokenyard.bench.offline import main as offline_main

    return offline_main(args)


def _chat(args: argparse.Namespace) -> int:
    from tokenyard.cli.chat import main as chat_main
    from tokenyard.config import default_api_key

    return chat_main(
        args.base_url,
        model=args.model,
        api_key=args.api_key or default_api_key(),
        system=args.system,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
    )


def _add_chat_parser(sub: Any) -> None:
    chat = sub.add_parser(
        "chat", help="chat with a running server in the terminal",
        description="Chat in the terminal with a running tokenyard (or any "
        "OpenAI-compatible server) through /v1/chat/completions, streamed. It prints the "
        "URL and the model it talks to before the first prompt; /exit or Ctrl-D ends.")
    chat.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                      help="the server's OpenAI-compatible base URL (default: %(default)s)")
    chat.add_argument("--model", help="model name (default: the first model the key may "
                      "use, as the server's /v1/models lists them)")
    chat.add_argument("--api-key", help="sent as a bearer token (default: $TOKENYARD_API_KEY, "
                      "else the development key in ./.tokenyard/dev-key)")
    chat.add_argument("--system", help="system message")
    chat.add_argument("--temperature", type=float,
                      help="0 to 2 (default: none sent, the deployment's default applies)")
    chat.add_argument("--max-tokens", type=int,
                      help="the most tokens per answer (default: the server's)")


def _positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI and Anthropic HTTP API")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind")
    serve.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    serve.add_argument("--replica-url",
                       help="use this running `tokenyard engine` instead of starting one "
                       "(called with $TOKENYARD_REPLICA_TOKEN)")
    serve.add_argument("--drain-timeout", type=float,
                       help="on SIGTERM, seconds to let in-flight requests finish "
                       "(default 30, $TOKENYARD_DRAIN_TIMEOUT_S)")
    serve.add_argument("--no-auth", dest="auth", action="store_false",
                       help="no API keys, limits, billing or ledger: anyone may call")
    serve.add_argument("--config", type=Path,
                       help="the fleet file (TOML: deployments, aliases, balancer); "
                       "reloaded on SIGHUP. Without it: the embedded model, as flags say")
    serve.add_argument("--replicas", type=int, default=1,
                       help="local engine replicas of the model (default 1)")
    serve.add_argument("--policy", choices=sorted(POLICIES),
                       default="affinity",
                       help="how the balancer picks a replica (default: prefix affinity, "
                       "then least outstanding work)")
    serve.add_argument("--queue-timeout", type=float, default=5.0,
                       help="seconds a request may wait at the balancer when every replica "
                       "is full, before 503/529 (default 5; 0: refuse at once)")
    serve.add_argument("--max-output-tokens", type=_positive_int,
                       help="without --config: the most output tokens of one request, and "
                       "what a request that sets no max_tokens gets (default "
                       f"{DEFAULT_MAX_OUTPUT_TOKENS}; a fleet file sets max_output_tokens "
                       "per deployment)")
    serve.add_argument("--tool-call-parser", default="auto",
                       choices=("auto", *TOOL_CALL_PARSERS),
                       help="without --config: how the model writes tool calls (default: "
                       "from its chat template; a fleet file sets tool_call_parser)")
    serve.add_argument("--reasoning-parser", default="auto",
                       choices=("auto", "none", *REASONING_PARSERS),
                       help="without --config: how the model marks its reasoning "
                       "(default: from its chat template)")
    serve.add_argument("--embeddings", dest="embeddings", action="store_true", default=None,
                       help="start the embeddings pool (/v1/embeddings) even with "
                       "--replica-url (the default only with a local replica)")
    serve.add_argument("--no-embeddings", dest="embeddings", action="store_false",
                       help="do not start the embeddings pool (/v1/embeddings)")
    serve.add_argument("--workers", type=int,
                       help="HTTP worker processes sharing the port (default 1, "
                       "$TOKENYARD_WORKERS)")
    serve.add_argument("--tls-cert", type=Path,
                       help="serve HTTPS with this certificate chain (PEM; with --tls-key; "
                       "$TOKENYARD_TLS_CERT)")
    serve.add_argument("--tls-key", type=Path,
                       help="the certificate's private key (PEM; $TOKENYARD_TLS_KEY)")
    serve.add_argument("--responses-retention-days", type=float,
                       help="days a stored response of /v1/responses is kept (default 30, "
                       "$TOKENYARD_RESPONSES_RETENTION_DAYS)")
    serve.add_argument("--edge-connections-per-address", type=int, dest="edge_connections",
                       help="open connections one client address may hold; the next is "
                       "refused with 429 (default 512, 0: no limit, "
                       "$TOKENYARD_EDGE_CONNECTIONS_PER_ADDRESS)")
    serve.add_argument("--edge-requests-per-s", type=float, dest="edge_rate",
                       help="requests per second one client address may send before 429 "
                       "(default 500, 0: no limit, $TOKENYARD_EDGE_REQUESTS_PER_S)")
    serve.add_argument("--header-timeout", type=float,
                       help="seconds a request head may take to arrive, and an idle "
                       "connection may stay open (default 60, $TOKENYARD_HEADER_TIMEOUT_S)")
    serve.add_argument("--max-header-bytes", type=int,
                       help="longest request line or header field (default 16384, "
                       "$TOKENYARD_MAX_HEADER_BYTES)")
    serve.add_argument("--stream-write-timeout", type=float,
                       help="seconds a stream's client may take to accept one write before "
                       "it is cut (default 60, $TOKENYARD_STREAM_WRITE_TIMEOUT_S)")
    serve.add_argument("--log-format", choices=["auto", "json", "text"], default="auto",
                       help="stderr log lines: auto (the default) is text on a terminal "
                       "and one JSON object per line anywhere else")
    serve.add_argument("--region",
                       help="a regional endpoint: serve only the deployments of this region "
                       "(a fleet file's `region`; without --config, the one deployment is "
                       "in it), $TOKENYARD_REGION")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                       default="info", help="the least severe level logged (default info; "
                       "each request's line is info)")
    serve.add_argument("--request-records-retention-hours", type=float,
                       dest="records_retention",
                       help="how long GET /v1/requests/{id} finds a request (default 24, "
                       "$TOKENYARD_REQUEST_RECORDS_RETENTION_HOURS)")
    serve.add_argument("--redact-pattern", action="append", metavar="REGEX",
                       help="also redact matches of this regular expression from captured "
                       "bodies (repeatable)")
    serve.add_argument("--batch-concurrency", type=int,
                       help="Batch API lines one gateway process runs at once (default "
                       "128, $TOKENYARD_BATCH_CONCURRENCY)")
    serve.add_argument("--batch-lease", type=float,
                       help="seconds a claimed batch line stays its worker's without a "
                       "renewal (default 60, $TOKENYARD_BATCH_LEASE_S)")
    serve.add_argument("--batch-enqueued-tokens", type=int,
                       help="estimated tokens an org's batches at work may hold unless the "
                       "org has its own quota (default 20000000, "
                       "$TOKENYARD_BATCH_ENQUEUED_TOKENS)")
    add_engine_args(serve)


#: `tokenyard bench` subcommands whose module gives their flags: (name, module, help).
_BENCHES = (
    ("serve", "tokenyard.bench.serve",
     "load-test any OpenAI- or Anthropic-compatible server"),
    ("gateway", "tokenyard.bench.gateway",
     "what tokenyard's HTTP process adds, in front of a mock replica"),
    ("fleet", "tokenyard.bench.fleet",
     "the balancer's policies side by side on a multi-turn workload"),
    ("peers", "tokenyard.bench.peers", "tokenyard beside llama.cpp's llama-server, built "
     "once into the cache (make bench-peers)"),
    ("batch", "tokenyard.bench.batch",
     "the Batch API's lane against the engine alone and beside live traffic"),
    ("host", "tokenyard.bench.host_path",
     "the host path alone: a model that costs nothing, the engine alone and served"),
    ("spec", "tokenyard.bench.spec", "n-gram speculative decoding against none, one stream"),
    ("lora", "tokenyard.bench.lora",
     "8 LoRA adapters at once against the base model alone, same concurrency"),
    ("agent", "tokenyard.bench.agent", "an agent task of 3 MCP calls run by the platform "
     "against a client loop over HTTP: hop overhead"),
    ("models", "tokenyard.bench.models", "an on-demand model: cold, warm and reload load "
     "times and the first request's TTFT"),
    ("ray", "tokenyard.cli.ray_bench",
     "a replica's start under Ray: actor created -> healthy"),
    ("suite", "tokenyard.bench.suite",
     "the standard benchmarks; rewrites docs/benchmarks.md (make bench)"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenyard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_engine_args(gen)

    _add_engine_parser(sub)
    _add_serve_parser(sub)
    add_embed_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_sub.add_parser("micro", help="small-M matmuls and SDPA kernels on this CPU")
    from tokenyard.bench.grammar import add_arguments as add_grammar_arguments

    add_grammar_arguments(bench_sub.add_parser(
        "grammar", help="constrained decoding: compile, mask and throughput costs"))
    from tokenyard.bench import profile as bench_profile

    prof = bench_sub.add_parser("profile", help="where one decode step's time goes")
    bench_profile.add_arguments(prof)
    add_engine_args(prof)
    offline = bench_sub.add_parser("offline", help="the engine alone, no HTTP")
    from tokenyard.bench.offline import add_arguments

    add_arguments(offline)
    add_engine_args(offline)
    for name, module, text in _BENCHES:  # each module's add_arguments fills its parser
        importlib.import_module(module).add_arguments(bench_sub.add_parser(name, help=text))

    _add_chat_parser(sub)
    _add_admin_parser(sub)
    return parser


def _add_engine_parser(sub: Any) -> None:
    engine = sub.add_parser("engine", help="run an engine replica: token ids over HTTP")
    engine.add_argument("--host", default="127.0.0.1",
                        help="address to bind; beyond loopback TOKENYARD_REPLICA_TOKEN is "
                        "required (callers send it as a bearer token)")
    engine.add_argument("--port", type=int, default=8001, help="port (0: any free port)")
    engine.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to let in-flight requests finish")
    add_engine_args(engine)


def _add_admin_parser(sub: Any) -> None:
    # Imported here: the admin commands import the gateway and its store (SQLAlchemy,
    # Alembic), which an engine replica's process never needs.
    from tokenyard.cli.admin import add_admin_parser

    add_admin_parser(sub)


#: Subcommands parsed without the full parser, which imports the benchmarks (and torch).
_LIGHT_PARSERS = {"serve": _add_serve_parser, "chat": _add_chat_parser,
                  "admin": _add_admin_parser, "embed": add_embed_parser,
                  "engine": _add_engine_parser}


def _light_parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenyard", description=__doc__)
    _LIGHT_PARSERS[command](parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command `argv` (None: this program's arguments) and return its exit code.
    Run as a program, a server command ends its process itself (cli/processes.py's
    end_process) once it has shut down in order."""
    args_given = list(sys.argv[1:] if argv is None else argv)
    light = args_given[0] if args_given and args_given[0] in _LIGHT_PARSERS else None
    parser = _light_parser(light) if light else build_parser()
    args = parser.parse_args(args_given)
    code = _run(args)
    if argv is None and args.command in ("engine", "embed", "serve"):
        end_process(code)
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command == "generate":
            from tokenyard.cli.generate import generate

            return asyncio.run(generate(args))
        if args.command == "engine":
            return _engine(args)
        if args.command == "embed":
            return _embed(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "admin":
            from tokenyard.cli.admin import run_admin

            return run_admin(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
