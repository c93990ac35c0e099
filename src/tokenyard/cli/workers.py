"""`tokenyard serve --workers N`: N HTTP worker processes on one port.

The parent (`tokenyard serve`) opens and migrates the store once (creating the development
key), starts the replicas, then runs a `WorkerPool`:

- **one port**: the parent binds host:port with SO_REUSEPORT without listening (so port
  0 becomes a real port and a port in use fails at once, in the parent), and every worker
  listens on it with SO_REUSEPORT: the kernel spreads new connections across them.
- **workers** are `python -m tokenyard.cli.worker_main` processes, each with its own
  `Gateway` on the same database (SQLite: WAL and a busy timeout, `store/db.py`, let
  several processes write) and its own ledger journal, `<journal dir>/worker-<i>`, which
  its start replays (a worker that died leaves its unflushed usage there). A worker reads
  its settings from one JSON value in its environment (`TOKENYARD_WORKER_SPEC`, secrets
  included, as the replica gets its token: never in argv), prints a ready line, and
  stamps each response with `x-tokenyard-worker: <its pid>`.
- **the fleet**: the parent's deployments (`worker_fleet`), its local replicas named by
  their URLs (the parent keeps and restarts them, on their ports); each worker builds
  pools of its own over them. With Redis the prefix-affinity table is Redis's
  (`gateway/redis_affinity.py`), so all workers (and gateway hosts) share it; without,
  each worker keeps its own. SIGHUP to the parent is passed on: each worker reloads the
  fleet file (a deployment that would need new local replicas is refused in its log).
- **limits** stay exact: with Redis each worker's `RedisLimiter` shares the buckets as
  separate gateway hosts do; without it the parent runs the one `InProcessLimiter` behind a
  `LimitServer` on a Unix socket in a private directory, and every worker's limiter is a
  `SocketLimiter` to it (`gateway/limit_server.py`). Money goes the same way: with Redis
  through `RedisMoney`; without, the parent's `MemoryMoney` holds every balance, cap and
  budget for all workers, over the same socket (`gateway/money_server.py`).
- **metrics**: the parent sets PROMETHEUS_MULTIPROC_DIR to a fresh directory for the
  workers (removed at exit); `/metrics` on any worker sums all of them
  (`telemetry/metrics.py`). A worker that exits is marked dead there, so the live-workers
  gauge drops it while its counts stay.
- **restarts**: a worker that exits while the pool is not draining is logged and started
  again under the same index (the same journal directory), after a pause that grows while
  it keeps dying young.
- **drain** (`WorkerPool.drain`, on SIGTERM to the parent): each worker gets SIGTERM, stops
  admitting (503 to new requests), closes its listening socket, lets its open responses
  finish (up to the drain timeout), flushes its ledger and exits; then the parent drains
  the replicas, which were serving those responses until the end.

Why separate interpreters started with `python -m` rather than `multiprocessing`: a worker
must be in prometheus_client's multiprocess mode from its first import, which a fresh
interpreter with the variable in its environment guarantees; nothing of the parent (its
event loop, its store connections, its replica processes) is inherited (only the fleet's
plain spec is passed, pickled); and
the parent supervises workers the way it supervises replicas, as asyncio subprocesses
that die with it (PR_SET_PDEATHSIG) — no fork of a process that runs an event loop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tokenyard.api.context import AppState
from tokenyard.cli.fleet import FleetBuilder
from tokenyard.config import ServeConfig, default_cache_dir
from tokenyard.deployments import DeploymentSpec, FleetSpec
from tokenyard.telemetry.metrics import MULTIPROC_DIR_ENV, mark_worker_dead

logger = logging.getLogger("tokenyard.workers")

#: The environment variable holding a worker's `WorkerSpec` (JSON).
WORKER_SPEC_ENV = "TOKENYARD_WORKER_SPEC"
#: The response header naming the worker (its pid) that served a request.
WORKER_HEADER = "x-tokenyard-worker"
#: What a worker prints on stdout once it listens.
READY_MARK = "tokenyard worker ready"
#: How long a worker may take to load its tokenizer and listen.
WORKER_START_TIMEOUT_S = 120.0
#: A worker that lived less than this is "dying young": its restarts back off.
YOUNG_S = 10.0
RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)
_PR_SET_PDEATHSIG = 1


@dataclass
class WorkerSpec:
    """What one worker needs to know, passed in its environment as JSON."""

    index: int
    host: str
    port: int
    #: The `FleetSpec` the worker serves (`worker_fleet`), pickled, in base64.
    fleet: str
    cache_dir: str | None = None
    #: Keys, limits, billing and the ledger (the gateway); off: anyone may call.
    auth: bool = True
    #: The parent's `LimitServer` socket; None: Redis (config.redis_url), or no auth.
    limit_socket: str | None = None
    #: `ServeConfig`'s fields, paths as text.
    config: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))

    def serve_config(self) -> ServeConfig:
        """The parent's `ServeConfig`, rebuilt (no second read of the environment)."""
        values = dict(self.config)
        for f in fields(ServeConfig):
            if "Path" in str(f.type) and values.get(f.name) is not None:
                values[f.name] = Path(values[f.name])
        return ServeConfig(**values)

    def fleet_spec(self) -> FleetSpec:
        # Our own parent wrote it into our environment: trusted as our own code is.
        spec = pickle.loads(base64.b64decode(self.fleet))
        assert isinstance(spec, FleetSpec)
        return spec


def worker_fleet(fleet: FleetBuilder, state: AppState) -> tuple[FleetSpec, dict[str, str]]:
    """The fleet a worker serves, and the environment it needs for it: the parent's spec,
    with each deployment's local replicas (the parent's children, which it keeps and
    restarts on their ports) turned into running URLs whose token the worker reads from a
    variable of its environment (`TOKENYARD_WORKER_TOKEN_<i>`)."""
    env: dict[str, str] = {}
    deployments: dict[str, DeploymentSpec] = {}
    for i, (name, spec) in enumerate(fleet.spec.deployments.items()):
        served = state.deployments.get(name)
        members = {m.id for m in served.pool.members} if served is not None else set()
        children = [c for c in fleet.children if c.url in members]
        if not children:
            deployments[name] = spec
            continue
        token = children[0].token
        others = spec.token() or fleet.config.replica_token
        if any(c.token != token for c in children) or (spec.urls and others != token):
            raise RuntimeError(f"--workers: deployment {name} has local replicas and running "
                               "URLs with different tokens; give them one token")
        var = f"TOKENYARD_WORKER_TOKEN_{i}"
        env[var] = token
        deployments[name] = dataclasses.replace(
            spec, replicas=0, urls=(*(c.url for c in children), *spec.urls), token_env=var)
    return dataclasses.replace(fleet.spec, deployments=deployments), env


def config_fields(config: ServeConfig) -> dict[str, Any]:
    """`config` as JSON-ready values (paths as text)."""
    return {f.name: (str(v) if isinstance(v := getattr(config, f.name), Path) else v)
            for f in fields(config)}


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT and not listening: it holds the port
    (port 0: picks one) for the workers, which bind it too, and receives no connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _die_with_parent() -> None:
    """In the worker before exec: SIGTERM when the parent dies (it then drains and exits)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(eq=False)
class _Worker:
    index: int
    proc: asyncio.subprocess.Process
    started: float
    forward: asyncio.Task[None] | None = None


class WorkerPool:
    """N worker processes serving host:port, supervised by this (the parent) process."""

    def __init__(
        self, count: int, host: str, port: int, *, fleet: FleetBuilder, state: AppState,
        config: ServeConfig, cache_dir: Path | None = None, auth: bool = True,
    ) -> None:
        """`fleet` and `state`: what the parent built (its replicas started, its
        deployments' pools, never started); the workers serve the same deployments."""
        if count < 1:
            raise ValueError(f"workers must be >= 1, not {count}")
        self.count = count
        self.host = host
        self.config = config
        self._state = state
        spec, self._env = worker_fleet(fleet, state)
        self._spec = WorkerSpec(
            index=0, host=host, port=port, fleet=base64.b64encode(pickle.dumps(spec)).decode(),
            cache_dir=str(cache_dir or default_cache_dir()), auth=auth,
            config=config_fields(config))
        self._reserved: socket.socket | None = None
        self._private_dir: Path | None = None
        self.metrics_dir: Path | None = None
        self._limit_server: Any = None  # LimitServer, when there are limits and no Redis
        self._workers: dict[int, _Worker] = {}
        self._supervise: asyncio.Task[None] | None = None
        self._draining = False
        self.restarts = 0

    @property
    def port(self) -> int:
        """The port every worker listens on."""
        return self._spec.port

    @property
    def pids(self) -> list[int]:
        """The live workers' pids, by index."""
        return [w.proc.pid for _, w in sorted(self._workers.items())]

    async def __aenter__(self) -> WorkerPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()

    async def start(self) -> None:
        """Hold the port, start the shared limiter (no Redis) and every worker; return
        once all of them listen. On failure everything started is stopped again."""
        try:
            self._reserved = reserve_port(self.host, self._spec.port)
            self._spec.port = self._reserved.getsockname()[1]
            self._private_dir = Path(tempfile.mkdtemp(prefix="tokenyard-workers-"))
            self.metrics_dir = self._private_dir / "metrics"
            self.metrics_dir.mkdir()
            if self._spec.auth and self.config.redis_url is None:
                from tokenyard.gateway.limit_server import LimitServer
                from tokenyard.gateway.money_server import MemoryMoney

                self._limit_server = LimitServer(self._private_dir / "limits.sock",
                                                 money=MemoryMoney())
                await self._limit_server.start()
                self._spec.limit_socket = str(self._limit_server.path)
            started = await asyncio.gather(
                *(self._spawn(i) for i in range(self.count)), return_exceptions=True)
            failed = [r for r in started if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
        except BaseException:
            await self.drain()
            raise
        self._supervise = asyncio.create_task(self._watch())

    async def _spawn(self, index: int) -> _Worker:
        spec = dataclasses.replace(self._spec, index=index)
        env = {**os.environ, **self._env, WORKER_SPEC_ENV: spec.to_json(),
               MULTIPROC_DIR_ENV: str(self.metrics_dir)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tokenyard.cli.worker_main", stdout=asyncio.subprocess.PIPE,
            stderr=None, preexec_fn=_die_with_parent, env=env,
            # Its own session: a terminal's Ctrl-C reaches the parent only, which drains
            # the workers itself (they would otherwise exit before it knows to stop).
            start_new_session=True)
        worker = _Worker(index, proc, time.monotonic())
        self._workers[index] = worker
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(WORKER_START_TIMEOUT_S):
                while True:
                    raw = await proc.stdout.readline()
                    if not raw:
                        code = await proc.wait()
                        raise RuntimeError(f"HTTP worker {index} exited with code {code} "
                                           "before it was ready (see its output above)")
                    line = raw.decode("utf-8", "replace")
                    if READY_MARK in line:
                        break
                    sys.stderr.write(line)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise
        worker.forward = asyncio.create_task(_forward(proc.stdout))
        logger.info("HTTP worker %d (pid %d) serving", index, proc.pid)
        return worker

    async def _watch(self) -> None:
        """Restart each worker that exits while the pool is not draining."""
        young_deaths: dict[int, int] = {}
        while not self._draining and self._workers:
            waits = {asyncio.ensure_future(w.proc.wait()): w for w in self._workers.values()}
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for future in pending:
                future.cancel()
            for future in done:
                worker = waits[future]
                self._forget(worker)
                if self._draining:
                    return
                lived = time.monotonic() - worker.started
                deaths = young_deaths.get(worker.index, 0) + 1 if lived < YOUNG_S else 0
                young_deaths[worker.index] = deaths
                pause = RESTART_BACKOFF_S[min(deaths, len(RESTART_BACKOFF_S) - 1)]
                logger.error("HTTP worker %d (pid %d) exited with code %s after %.1f s; "
                             "restarting it%s", worker.index, worker.proc.pid,
                             worker.proc.returncode, lived,
                             f" in {pause:.1f} s" if pause else "")
                await asyncio.sleep(pause)
                while not self._draining:
                    try:
                        await self._spawn(worker.index)
                        self.restarts += 1
                        break
                    except Exception as exc:
                        logger.error("HTTP worker %d failed to start: %s; retrying",
                                     worker.index, exc)
                        await asyncio.sleep(RESTART_BACKOFF_S[-1])

    def _forget(self, worker: _Worker) -> None:
        if self._workers.get(worker.index) is worker:
            del self._workers[worker.index]
        if worker.forward is not None:
            worker.forward.cancel()
        if self.metrics_dir is not None:
            with contextlib.suppress(OSError):
                mark_worker_dead(worker.proc.pid, str(self.metrics_dir))

    def send(self, sig: int) -> None:
        """Send `sig` to every live worker (SIGHUP: each reloads the fleet file)."""
        for worker in self._workers.values():
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(sig)

    async def drain(self) -> None:
        """SIGTERM every worker and wait for it (each finishes its open responses, up to
        the drain timeout); then stop the limiter, remove the private directory and close
        the parent's own pools (built to describe the fleet, never started). Idempotent."""
        self._draining = True
        if self._supervise is not None:
            self._supervise.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervise
            self._supervise = None
        limit = self.config.drain_timeout_s + 10.0

        async def stop(worker: _Worker) -> None:
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(worker.proc.wait(), limit)
            except TimeoutError:
                logger.error("HTTP worker %d did not drain in %.0f s; killing it",
                             worker.index, limit)
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()
                await worker.proc.wait()
            self._forget(worker)

        await asyncio.gather(*(stop(w) for w in list(self._workers.values())))
        if self._limit_server is not None:
            await self._limit_server.close()
            self._limit_server = None
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None
        for served in self._state.deployments.values():
            await served.pool.close()


async def _forward(stream: asyncio.StreamReader) -> None:
    """Copy a worker's remaining stdout to our stderr (its logs stay visible)."""
    while line := await stream.readline():
        sys.stderr.write(line.decode("utf-8", "replace"))
        sys.stderr.flush()
