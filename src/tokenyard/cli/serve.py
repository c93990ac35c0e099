"""`tokenyard serve`: the HTTP process plus (unless given one) its engine replica process.

The replica (`tokenyard engine`) is a child process on a free local port: it alone imports
torch and runs the step loop; this process stays torch-free and serves the HTTP API. The
child gets a shared secret through its environment (TOKENYARD_REPLICA_TOKEN: the one set
here, else a random one) and refuses every caller without it. Settings are read once into
a `ServeConfig` (defaults < TOKENYARD_* environment < flags) and passed down. On
SIGTERM/SIGINT this process stops admitting, asks the replica to drain (it finishes or
aborts in-flight requests within its bound), lets the open responses end, and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from tokenyard.api.app import build_state, make_app
from tokenyard.balancer.replica_client import ReplicaError
from tokenyard.config import REPLICA_TOKEN_ENV, ServeConfig, default_cache_dir
from tokenyard.gateway.limits import InProcessLimiter, Limiter
from tokenyard.gateway.pipeline import Gateway

logger = logging.getLogger("tokenyard.serve")

#: The replica's ready line, printed by `tokenyard engine` once it listens.
_READY_MARK = " serving at "
#: After the replica has drained, how long open HTTP responses may take to finish.
HTTP_SHUTDOWN_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1
#: Connections the kernel queues before accept (aiohttp's default, 128, overflows in bursts
#: at ~1,000 requests/s and each dropped client waits a second to retry; capped by somaxconn).
LISTEN_BACKLOG = 1024



def make_limiter(redis_url: str | None) -> Limiter:
    """A limiter shared through Redis when a URL is given (scale-out), else in process."""
    if redis_url is None:
        return InProcessLimiter()
    from tokenyard.gateway.redis_limits import RedisLimiter  # only scale-out needs redis

    return RedisLimiter(redis_url)


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends it SIGTERM when this process dies, so a
    crashed or SIGKILLed server never leaves an orphan replica holding the model."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


async def _forward_output(stream: asyncio.StreamReader) -> None:
    """Copy the replica's remaining output to our stderr (its logs stay visible)."""
    while line := await stream.readline():
        sys.stderr.write(line.decode("utf-8", "replace"))
        sys.stderr.flush()


async def start_replica(
    engine_args: Sequence[str], config: ServeConfig, token: str
) -> tuple[asyncio.subprocess.Process, str, asyncio.Task[None]]:
    """Start `tokenyard engine` on a free 127.0.0.1 port, requiring `token` of its callers
    (passed in its environment: argv is visible to every user of the machine); return it
    once it listens."""
    cmd = [sys.executable, "-m", "tokenyard.cli", "engine", "--host", "127.0.0.1",
           "--port", "0", "--drain-timeout", str(config.drain_timeout_s), *engine_args]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=None, preexec_fn=_die_with_parent,
        env={**os.environ, REPLICA_TOKEN_ENV: token},
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(config.replica_start_timeout_s):
            while True:
                raw = await proc.stdout.readline()
                if not raw:
                    code = await proc.wait()
                    raise RuntimeError(f"the engine replica exited with code {code} before "
                                       "it was ready (see its output above)")
                line = raw.decode("utf-8", "replace")
                if _READY_MARK in line:
                    url = line.rsplit(_READY_MARK, 1)[1].strip()
                    break
                sys.stderr.write(line)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise
    return proc, url, asyncio.create_task(_forward_output(proc.stdout))


def banner(base_url: str, model: str, replica_url: str, api_key: str | None = None) -> str:
    """What a person needs to start using the server, ready to paste."""
    curl_body = json.dumps({"model": model,
                            "messages": [{"role": "user", "content": "Say hello."}]})
    key_lines = [f"  API key: {api_key}"] if api_key else []
    auth_header = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return "\n".join([
        f"tokenyard serving {model} at {base_url}",
        f"  OpenAI base URL:    {base_url}/v1",
        f"  Anthropic base URL: {base_url}",
        *key_lines,
        f"  replica: {replica_url}",
        "",
        "curl:",
        f"  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json'"
        f"{auth_header} \\",
        f"    -d '{curl_body}'",
        "",
        "Python:",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{base_url}/v1", api_key="{api_key or "unused"}")',
        f'  r = client.chat.completions.create(model="{model}",',
        '      messages=[{"role": "user", "content": "Say hello."}])',
        "  print(r.choices[0].message.content)",
        "",
    ])


async def run(
    host: str,
    port: int,
    engine_args: Sequence[str],
    *,
    model: str | None,
    config: ServeConfig,
    replica_url: str | None = None,
    cache_dir: Path | None = None,
    auth: bool = True,
) -> int:
    """Serve until SIGTERM/SIGINT, then drain and return 0. `auth`: API keys, limits,
    billing and the ledger (the gateway); off, anyone may call. `replica_url`: a running
    replica, called with `config.replica_token`; None starts a child replica."""
    proc: asyncio.subprocess.Process | None = None
    forward: asyncio.Task[None] | None = None
    gateway: Gateway | None = None
    api_key: str | None = None
    token = config.replica_token
    if auth:
        gateway, api_key = await open_gateway(config)
    runner: web.AppRunner | None = None
    try:
        if replica_url is None:
            token = token or secrets.token_urlsafe(32)
            proc, replica_url, forward = await start_replica(engine_args, config, token)
        try:
            state = await build_state(replica_url, model, cache_dir or default_cache_dir(),
                                      replica_token=token)
        except ReplicaError as exc:
            raise RuntimeError(f"cannot reach the replica at {replica_url}: {exc}") from exc
        state.gateway = gateway
        state.max_body_bytes = config.max_body_bytes
        # handler_cancellation: a client that goes away cancels its handler, which closes
        # the replica stream, which aborts the request there and frees its blocks.
        runner = web.AppRunner(make_app(state), handler_cancellation=True,
                               shutdown_timeout=HTTP_SHUTDOWN_TIMEOUT_S, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        shown = f"[{host}]" if ":" in host else host
        print(banner(f"http://{shown}:{bound}", state.model, replica_url, api_key), flush=True)

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        child_exit = asyncio.ensure_future(proc.wait()) if proc is not None else None
        waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait())]
        if child_exit is not None:
            waiters.append(child_exit)
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            logger.error("the engine replica exited unexpectedly")
            print("tokenyard serve: the engine replica exited; stopping", file=sys.stderr)
            return 1
        # Stop admitting new requests; in-flight ones go on while the replica drains.
        state.admitting = False
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), config.drain_timeout_s + 10.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        return 0
    finally:
        if runner is not None:
            await runner.cleanup()
        if gateway is not None:
            await gateway.close()
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        if forward is not None:
            forward.cancel()


async def open_gateway(config: ServeConfig) -> tuple[Gateway, str | None]:
    """The gateway over `config.database` (TOKENYARD_DATABASE_URL, else SQLite in the state
    directory) and `config.redis_url` (else in-process limits), and the development key to
    show.

    On an empty database the default org and an admin key are created; the key is kept
    in `<state dir>/dev-key` (mode 0600) so later starts can show it again.
    """
    config.state_dir.mkdir(parents=True, exist_ok=True)
    gateway, new_key = await Gateway.open(
        config.database, make_limiter(config.redis_url), config.journal_dir, config=config
    )
    key_file = config.dev_key_file
    if new_key is not None:
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(new_key + "\n")
        print(f"created org 'default' and an admin API key (kept in {key_file})", flush=True)
        return gateway, new_key
    try:
        return gateway, key_file.read_text().strip() or None
    except OSError:
        return gateway, None


def serve(
    host: str,
    port: int,
    engine_args: Sequence[str],
    *,
    model: str | None,
    config: ServeConfig,
    replica_url: str | None = None,
    auth: bool = True,
) -> int:
    """Blocking entry point of `tokenyard serve`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return asyncio.run(run(host, port, engine_args, model=model, config=config,
                           replica_url=replica_url, auth=auth))
