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
import json
import logging
import os
import shlex
import signal
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web

from tokenyard.api.app import make_app
from tokenyard.api.context import AppState
from tokenyard.api.convert import now
from tokenyard.api.edge import EdgeLimits, edge_runner, start_edge
from tokenyard.balancer.affinity import AffinityTable
from tokenyard.balancer.replica_client import ReplicaError
from tokenyard.cli.fleet import FleetBuilder, Starter, reload
from tokenyard.cli.gc_tuning import tune_gc
from tokenyard.cli.processes import start_child
from tokenyard.cli.ray_admin import ray_scaler
from tokenyard.cli.workers import WorkerPool
from tokenyard.config import ServeConfig, default_cache_dir
from tokenyard.deployments import DeploymentSpec, load_fleet, single_fleet
from tokenyard.gateway.background import BackgroundSettings
from tokenyard.gateway.batches import BatchSettings
from tokenyard.gateway.gate import Gateway
from tokenyard.gateway.kinds import kind_of
from tokenyard.gateway.limits import InProcessLimiter, Limiter
from tokenyard.gateway.money_holds import SharedHolds
from tokenyard.gateway.routing import Router
from tokenyard.gateway.served import Served
from tokenyard.lora_spec import AdapterSpec, with_adapters
from tokenyard.telemetry import logs

logger = logging.getLogger("tokenyard.serve")

#: After the replicas have drained, how long open HTTP responses may take to finish.
HTTP_SHUTDOWN_TIMEOUT_S = 10.0
#: Connections the kernel queues before accept (aiohttp's default, 128, overflows in bursts
#: at ~1,000 requests/s and each dropped client waits a second to retry; capped by somaxconn).
LISTEN_BACKLOG = 1024
#: The embeddings deployment `serve` adds unless --no-embeddings.
EMBEDDINGS_MODEL = "all-minilm-l6-v2"


def with_embeddings(asked: bool | None, replica_url: str | None) -> bool:
    """Whether `serve` without a fleet file starts the embeddings pool: as asked
    (``--embeddings``, ``--no-embeddings``), else only when it starts its own replica."""
    return asked if asked is not None else replica_url is None


def make_limiter(redis_url: str | None) -> Limiter:
    """A limiter shared through Redis when a URL is given (scale-out), else in process."""
    if redis_url is None:
        return InProcessLimiter()
    from tokenyard.gateway.redis_limits import RedisLimiter  # only scale-out needs redis

    return RedisLimiter(redis_url)


def make_money(config: ServeConfig) -> SharedHolds | None:
    """Money holds shared through Redis when a URL is given (every gateway process holds
    and settles the same balances, caps and budgets), else None (in process)."""
    if config.redis_url is None:
        return None
    from tokenyard.gateway.redis_money import RedisMoney

    return RedisMoney(config.redis_url, hold_ttl=config.money_hold_ttl_s)


def make_affinity(redis_url: str | None) -> AffinityTable | None:
    """The prefix-affinity table shared through Redis when a URL is given (gateways on
    several hosts route a conversation to the same replica), else None (in process)."""
    if redis_url is None:
        return None
    from tokenyard.gateway.redis_affinity import RedisAffinity

    return RedisAffinity(redis_url)


def make_starter(engine_args: Sequence[str], config: ServeConfig) -> Starter:
    """How the fleet starts a local replica of a deployment: `tokenyard engine` with the
    serve command's engine flags, the deployment's own and its model; `tokenyard embed`."""
    async def start(spec: DeploymentSpec, token: str, port: int) -> tuple[
            asyncio.subprocess.Process, str, asyncio.Task[None]]:
        kind = kind_of(spec)
        return await start_child(kind.replica_command(spec, engine_args), config, token,
                                 port=port, what=f"{kind.name} replica")
    return start


def masked(key: str) -> str:
    """A key as a banner shows it after the start that created it: its kind and its last
    characters, enough to tell keys apart ("sk-ty-…abcd")."""
    return f"{key[:6]}…{key[-4:]}" if len(key) > 12 else "…"


def banner(base_url: str, model: str, replica_url: str, api_key: str | None = None,
           key_file: Path | None = None, region: str | None = None) -> str:
    """What a person needs to start using the server, ready to paste: first the pages a
    person opens (the chat page, the dashboard), then the API. The development key
    appears whole only when it was just created (`key_file` None); on later starts the
    banner masks it and the snippets read it from `key_file`, so that the key is not
    written to every log the server's output lands in. `region`: a regional endpoint."""
    curl_body = json.dumps({"model": model,
                            "messages": [{"role": "user", "content": "Say hello."}]})
    key_lines, auth_header, python_key = [], "", '"unused"'
    if api_key and key_file is None:
        key_lines = [f"  API key: {api_key}"]
        auth_header, python_key = f" -H 'Authorization: Bearer {api_key}'", f'"{api_key}"'
    elif api_key and key_file is not None:
        where = str(key_file.absolute())
        key_lines = [f"  API key: {masked(api_key)} (the whole key is in {where})"]
        auth_header = f' -H "Authorization: Bearer $(cat {shlex.quote(where)})"'
        python_key = f"open({where!r}).read().strip()"
    sign_in = " (paste the API key)" if api_key else ""
    return "\n".join([
        f"tokenyard serving {model} at {base_url}",
        f"  Chat in the browser: {base_url}/{sign_in}",
        f"  Dashboard:           {base_url}/dashboard{sign_in}",
        *key_lines,
        f"  OpenAI base URL:     {base_url}/v1",
        f"  Anthropic base URL:  {base_url}",
        *([f"  region: {region} (this endpoint serves only its deployments)"]
          if region else []),
        f"  replica: {replica_url}",
        "",
        "curl:",
        f"  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json'"
        f"{auth_header} \\",
        f"    -d '{curl_body}'",
        "",
        "Python:",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{base_url}/v1", api_key={python_key})',
        f'  r = client.chat.completions.create(model="{model}",',
        '      messages=[{"role": "user", "content": "Say hello."}])',
        "  print(r.choices[0].message.content)",
        "",
    ])


def log_banner(base_url: str, model: str, replica_url: str, api_key: str | None,
               key_file: Path | None, region: str | None) -> None:
    """The banner as one JSON log record (`--log-format json`): the same addresses, the
    key masked and where it is kept; the whole key never goes to a log."""
    logger.info("tokenyard serving %s at %s", model, base_url, extra={
        "event": "banner", "model": model, "base_url": base_url,
        "chat_url": f"{base_url}/", "dashboard_url": f"{base_url}/dashboard",
        "openai_base_url": f"{base_url}/v1", "anthropic_base_url": base_url,
        "replica": replica_url, "region": region,
        "api_key": masked(api_key) if api_key else None,
        "api_key_file": str(key_file.absolute()) if key_file else None})


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
    fleet_file: Path | None = None,
    replicas: int = 1,
    embeddings: bool | None = None,
    policy: str = "affinity",
    queue_timeout_s: float = 5.0,
    max_output_tokens: int | None = None,
    parsers: tuple[str, str] = ("auto", "auto"),
) -> int:
    """Serve until SIGTERM/SIGINT, then drain and return 0. `auth`: API keys, limits,
    billing and the ledger (the gateway); off, anyone may call. `fleet_file`: the
    deployments (reloaded on SIGHUP); without it, one engine deployment of `replicas`
    local replicas (or the running `replica_url`, called with `config.replica_token`),
    plus the embeddings pool where `embeddings` says (None: only beside a local replica,
    so a gateway in front of `replica_url` starts no model process); `max_output_tokens`
    is that deployment's output cap (None: the default), `parsers` its tool-call and
    reasoning parsers."""
    gateway: Gateway | None = None
    api_key: str | None = None
    key_file: Path | None = None  # where the key shown masked is (None: shown whole)
    if fleet_file is not None:
        spec = load_fleet(fleet_file)
    else:
        spec = single_fleet(
            "", replicas=replicas, urls=[replica_url] if replica_url else [], model=model,
            embeddings=EMBEDDINGS_MODEL if with_embeddings(embeddings, replica_url) else None,
            policy=policy,
            queue_timeout_s=queue_timeout_s, max_output_tokens=max_output_tokens,
            tool_call_parser=parsers[0], reasoning_parser=parsers[1])
    fleet = FleetBuilder(spec, make_starter(engine_args, config), config,
                         cache_dir or default_cache_dir(),
                         affinity=make_affinity(config.redis_url))
    runner: web.AppRunner | None = None
    workers: WorkerPool | None = None
    building = asyncio.create_task(fleet.build())  # the replicas load while the store opens
    try:
        if auth:
            gateway, api_key, key_file = await open_gateway(config)
        try:
            deployments = await building
        except ReplicaError as exc:
            raise RuntimeError(f"cannot reach a replica: {exc}") from exc
        if fleet_file is None:
            deployments = _name_default(fleet, deployments)
        if gateway is not None:
            await gateway.set_prices({n: s.spec.prices for n, s in deployments.items()
                                      if s.spec.prices is not None})
        state = AppState(deployments, Router(fleet.spec), now())
        state.gateway = gateway
        state.region = config.region
        state.max_body_bytes = config.max_body_bytes
        state.edge = EdgeLimits.of(config)
        state.batch = BatchSettings.of(config)
        state.background = BackgroundSettings.of(config)
        state.scaler = ray_scaler(fleet.spec, config)
        if config.workers > 1:  # they serve; this process supervises (cli/workers.py)
            workers = WorkerPool(config.workers, host, port, fleet=fleet, state=state,
                                 config=config, cache_dir=cache_dir, auth=auth)
            await workers.start()
            bound = workers.port
        else:
            runner = edge_runner(make_app(state), shutdown_timeout=HTTP_SHUTDOWN_TIMEOUT_S)
            await start_edge(runner)
            site = web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG,
                               ssl_context=config.ssl_context())
            await site.start()
            bound = runner.addresses[0][1] if runner.addresses else port
        # Before the banner: whoever waits for it may send SIGTERM at once, and it must drain.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: workers.send(signal.SIGHUP) if workers
                                else asyncio.ensure_future(_reload(fleet, state)))
        shown = f"[{host}]" if ":" in host else host
        replica_urls = ", ".join(m.id for m in state.default.pool.members) or (
            "loaded on demand" if state.default.pool.demand is not None else "")
        scheme = "https" if config.tls_cert is not None else "http"
        base_url = f"{scheme}://{shown}:{bound}"
        if logs.active_format == "json":  # a file or a collector: one JSON record
            log_banner(base_url, state.model, replica_urls, api_key,
                       key_file or (config.dev_key_file if api_key else None), config.region)
        else:
            print(banner(base_url, state.model, replica_urls, api_key, key_file,
                         config.region), flush=True)
        logger.info("serving %s on port %d", state.model, bound, extra={
            "event": "started", "model": state.model, "host": host, "port": bound,
            "deployments": {n: [m.id for m in s.pool.members]
                            for n, s in state.deployments.items()},
            "workers": config.workers, "auth": auth, "region": config.region})

        await stop.wait()
        # Stop admitting new requests; in-flight ones go on while the replicas drain.
        state.admitting = False
        began = time.monotonic()
        logger.info("draining: no new requests; waiting up to %.0f s for those in flight",
                    config.drain_timeout_s, extra={
                        "event": "draining", "timeout_s": config.drain_timeout_s})
        if workers is not None:  # the workers drain first: the replicas serve them meanwhile
            await workers.drain()
        for served in state.deployments.values():  # draining replicas answer 503 now
            await served.pool.stop_health()
        await fleet.stop(config.drain_timeout_s)
        took = round(time.monotonic() - began, 3)
        logger.info("drained in %.1f s", took, extra={"event": "drained", "seconds": took})
        return 0
    finally:
        if not building.done():  # the store failed to open: no child starts after kill()
            building.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await building
        if workers is not None:
            await workers.drain()
        if runner is not None:
            await runner.cleanup()
        if gateway is not None:
            await gateway.close()
        if fleet.affinity is not None:
            await fleet.affinity.close()
        fleet.kill()
        await fleet.stop(0.0)


def _name_default(fleet: FleetBuilder, deployments: dict[str, Served]) -> dict[str, Served]:
    """Without a fleet file the engine deployment is named after the model its replica
    reports (as before deployments existed)."""
    served = deployments.pop("")
    assert served.info is not None
    # Its replica's LoRA adapters (`serve --lora-modules`) as `model:adapter`.
    adapters = tuple(AdapterSpec(name, "") for name in served.info.loras or ())
    served.spec = replace(served.spec, name=served.info.model, adapters=adapters)
    served.pool.name = served.spec.name
    out = {served.name: served, **deployments}
    for spec in with_adapters({served.name: served.spec}).values():
        if spec.parent is not None:
            out[spec.name] = served.adapter(spec)
    fleet.spec = replace(fleet.spec, deployments={n: s.spec for n, s in out.items()})
    return out


async def _reload(fleet: FleetBuilder, state: AppState) -> None:
    """SIGHUP: reload the fleet file (`reload` logs the outcome)."""
    try:
        await reload(fleet, state)
    except Exception as exc:  # a bad file keeps the running fleet
        logger.error("reload failed, keeping the running fleet: %s", exc,
                     extra={"event": "reload_failed", "error": str(exc)})


async def open_gateway(config: ServeConfig) -> tuple[Gateway, str | None, Path | None]:
    """The gateway over `config.database` (TOKENYARD_DATABASE_URL, else SQLite in the state
    directory) and `config.redis_url` (else in-process limits), the development key to
    show, and the file it was read from (None: it was created just now, and this start is
    the one that shows it whole).

    On an empty database the default org and an admin key are created: the operator's
    (`TOKENYARD_ADMIN_KEY`, then neither kept nor shown) or a new one, kept in
    `<state dir>/dev-key` (mode 0600) so later starts can point to it. The state
    directory (the SQLite file, the ledger journal, the key) is its owner's only: 0700.
    """
    private_dir(config.state_dir)
    private_dir(config.journal_dir)
    gateway, new_key = await Gateway.open(
        config.database, make_limiter(config.redis_url), config.journal_dir, config=config,
        money=make_money(config))
    key_file = config.dev_key_file
    if config.admin_key is not None:  # the operator's: neither written nor shown whole
        if new_key is not None:
            logger.info("created org 'default' with the admin key of TOKENYARD_ADMIN_KEY",
                        extra={"event": "default_org_created", "admin_key": "environment"})
        return gateway, None, None
    if new_key is not None:
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(new_key + "\n")
        logger.info("created org 'default' and an admin API key (kept in %s)", key_file,
                    extra={"event": "default_org_created", "admin_key": str(key_file)})
        return gateway, new_key, None
    try:
        return gateway, key_file.read_text().strip() or None, key_file
    except OSError:
        return gateway, None, None


def private_dir(path: Path) -> None:
    """Create `path` 0700, or narrow it to 0700 (a state directory an earlier version made
    0755); one this user does not own is left as it is, with a warning."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        try:
            path.chmod(0o700)
        except PermissionError:
            logger.warning("%s is readable by other users and not this user's to change",
                           path, extra={"event": "state_dir_shared", "path": str(path)})


def serve(host: str, port: int, engine_args: Sequence[str], *, log_format: str = "auto",
          log_level: str = "info", **kwargs: Any) -> int:
    """Blocking entry point of `tokenyard serve` (other keyword arguments: `run`'s).
    The log settings reach the worker processes through the environment (`auto` decided
    here, on this process's stderr)."""
    log_format = logs.resolve_format(log_format)
    os.environ[logs.FORMAT_ENV], os.environ[logs.LEVEL_ENV] = log_format, log_level
    logs.configure(log_format, log_level)
    tune_gc()
    return asyncio.run(run(host, port, engine_args, **kwargs))
