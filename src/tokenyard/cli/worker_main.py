"""One HTTP worker process of `tokenyard serve --workers N`, run as
`python -m tokenyard.cli.worker_main`.

Its parent's `WorkerPool` (`cli/workers.py`) starts it with its `WorkerSpec` in the
environment; it serves the shared port until SIGTERM, then drains.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from tokenyard.api.context import AppState
from tokenyard.api.edge import EdgeLimits, edge_runner, start_edge
from tokenyard.cli.fleet import FleetBuilder
from tokenyard.cli.gc_tuning import tune_gc
from tokenyard.cli.ray_admin import ray_scaler
from tokenyard.cli.workers import READY_MARK, WORKER_HEADER, WORKER_SPEC_ENV, WorkerSpec
from tokenyard.config import default_cache_dir
from tokenyard.deployments import DeploymentSpec
from tokenyard.gateway.background import BackgroundSettings
from tokenyard.gateway.batches import BatchSettings
from tokenyard.telemetry import logs

logger = logging.getLogger("tokenyard.workers")

#: Connections the kernel queues per worker before accept (as serve.LISTEN_BACKLOG).
LISTEN_BACKLOG = 1024


async def run_worker(spec: WorkerSpec) -> int:
    """One worker: its gateway, the fleet's deployments (pools of its own over the parent's
    replicas), the app, a listening socket shared with its siblings; on SIGTERM/SIGINT it
    drains and returns 0; on SIGHUP it reloads the fleet file."""
    from aiohttp import web

    from tokenyard.api.app import make_app
    from tokenyard.api.convert import now
    from tokenyard.cli.fleet import reload
    from tokenyard.cli.serve import make_money
    from tokenyard.gateway.gate import Gateway
    from tokenyard.gateway.limits import Limiter
    from tokenyard.gateway.routing import Router

    config = spec.serve_config()
    gateway: Gateway | None = None
    runner: web.AppRunner | None = None
    affinity: Any = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if config.redis_url is not None:  # several workers (and hosts) share one table
            from tokenyard.gateway.redis_affinity import RedisAffinity

            affinity = RedisAffinity(config.redis_url)
        if spec.auth:
            limiter: Limiter
            money = make_money(config)
            if spec.limit_socket is not None:  # limits and money are the parent's
                from tokenyard.gateway.limit_server import SocketLimiter
                from tokenyard.gateway.money_server import SocketMoney

                limiter = SocketLimiter(spec.limit_socket)
                money = SocketMoney(limiter)
            else:
                from tokenyard.gateway.redis_limits import RedisLimiter

                assert config.redis_url is not None
                limiter = RedisLimiter(config.redis_url)
            gateway, _ = await Gateway.open(
                config.database, limiter, config.journal_dir / f"worker-{spec.index}",
                config=config, money=money)
        fleet = FleetBuilder(spec.fleet_spec(), _no_local_replicas, config,
                             Path(spec.cache_dir or default_cache_dir()), affinity=affinity)
        deployments = await fleet.build()
        state = AppState(deployments, Router(fleet.spec), now())
        state.gateway = gateway
        state.region = config.region
        state.max_body_bytes = config.max_body_bytes
        state.edge = EdgeLimits.of(config)
        state.batch = BatchSettings.of(config)
        state.background = BackgroundSettings.of(config)
        state.scaler = ray_scaler(fleet.spec, config)
        app = make_app(state)
        pid = str(os.getpid())

        async def stamp(request: web.Request, response: web.StreamResponse) -> None:
            response.headers[WORKER_HEADER] = pid

        app.on_response_prepare.append(stamp)
        # Open responses get the whole drain timeout: the replicas serve them meanwhile.
        runner = edge_runner(app, shutdown_timeout=config.drain_timeout_s)
        await start_edge(runner)
        await web.TCPSite(runner, spec.host, spec.port, backlog=LISTEN_BACKLOG,
                          reuse_port=True, ssl_context=config.ssl_context()).start()

        async def reload_fleet() -> None:
            try:
                logger.info("worker %d: %s", spec.index, await reload(fleet, state))
            except Exception as exc:  # a bad file keeps the running fleet
                logger.error("worker %d: reload failed, keeping the running fleet: %s",
                             spec.index, exc)

        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(reload_fleet()))
        print(f"{READY_MARK}: worker {spec.index} pid {pid}", flush=True)
        await stop.wait()
        state.admitting = False
        return 0
    finally:
        if runner is not None:
            await runner.cleanup()  # stops listening, waits for open responses
        if gateway is not None:
            await gateway.close()  # flushes the ledger
        if affinity is not None:
            await affinity.close()


async def _no_local_replicas(spec: DeploymentSpec, token: str, port: int) -> Any:
    """A worker's `Starter`: replicas are the parent's to start."""
    raise RuntimeError(f"deployment {spec.name}: local replicas are started by the parent; "
                       "with --workers, restart serve to add them")


def main() -> int:
    logs.configure()  # the format and level `tokenyard serve` put in the environment
    raw = os.environ.pop(WORKER_SPEC_ENV, None)  # children of ours need not see it
    if not raw:
        print(f"error: {WORKER_SPEC_ENV} is not set: workers are started by "
              "`tokenyard serve --workers N`", file=sys.stderr)
        return 2
    tune_gc()
    return asyncio.run(run_worker(WorkerSpec.from_json(raw)))


if __name__ == "__main__":
    sys.exit(main())
