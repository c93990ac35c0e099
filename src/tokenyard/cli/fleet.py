"""Building the fleet `tokenyard serve` serves: its local replica processes, the clients of
every replica and upstream, one `Served` per deployment, and reloading it on SIGHUP.

Local replicas are children of this process on fixed local ports: one that dies is
started again on the same port, so the balancer's member (its URL) stays the same and is
re-admitted once its health check passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from tokenyard.api.context import AppState
from tokenyard.balancer.affinity import AffinityTable
from tokenyard.balancer.discovery import Discovery, dns_source, is_dns_url, make_resolver
from tokenyard.balancer.member_clients import MemberClient
from tokenyard.balancer.on_demand import ModelHost, OnDemand
from tokenyard.balancer.pool import Pool
from tokenyard.config import ServeConfig
from tokenyard.deployments import DeploymentSpec, FleetSpec, load_fleet
from tokenyard.fleet_values import FleetConfigError
from tokenyard.gateway.kinds import build_served, kind_of
from tokenyard.gateway.regions import regional_fleet
from tokenyard.gateway.served import Served
from tokenyard.lora_spec import lora_modules_arg
from tokenyard.text.tokenizer import Tokenizer

logger = logging.getLogger("tokenyard.serve")

#: Starts one local replica process: (spec, token, port 0 = any) → (process, url, log task).
Starter = Callable[[DeploymentSpec, str, int],
                   Awaitable[tuple[asyncio.subprocess.Process, str, asyncio.Task[None]]]]


@dataclass(eq=False)
class LocalReplica:
    """A child replica process this server started, and restarts if it dies."""

    spec: DeploymentSpec
    token: str
    proc: asyncio.subprocess.Process
    url: str
    forward: asyncio.Task[None]
    restarts: int = 0
    #: Stopped for good (an on-demand model unloaded): not started again.
    retired: bool = False

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 0


@dataclass(eq=False)
class FleetBuilder:
    """What serve runs: the spec, its local children and how to start more."""

    spec: FleetSpec
    starter: Starter
    config: ServeConfig
    cache_dir: Path
    affinity: AffinityTable | None = None
    children: list[LocalReplica] = field(default_factory=list)
    tokenizers: dict[str | None, Tokenizer] = field(default_factory=dict)
    stopping: bool = False
    _watch: list[asyncio.Task[None]] = field(default_factory=list)
    background: set[asyncio.Task[None]] = field(default_factory=set)
    #: The resident on-demand models and their budget (`balancer/on_demand.py`).
    host: ModelHost = field(default_factory=ModelHost)

    def __post_init__(self) -> None:
        # A regional endpoint (`serve --region R`) builds, serves and lists only R's.
        self.spec = regional_fleet(self.spec, self.config.region)
        self.host.max_resident = self.spec.models.max_resident_models
        on_demand = [s.name for s in self.spec.deployments.values() if s.on_demand]
        if on_demand and self.config.workers > 1:
            raise FleetConfigError(
                f"load = \"on_demand\" ({', '.join(on_demand)}) needs serve's one HTTP "
                "process (--workers 1): each worker would load the model for itself")

    async def start_children(self, spec: DeploymentSpec) -> list[LocalReplica]:
        """Start `spec.replicas` local processes of a deployment, all at once."""
        token = self.config.replica_token or secrets.token_urlsafe(32)
        started = await asyncio.gather(
            *(self.starter(spec, token, 0) for _ in range(spec.replicas)),
            return_exceptions=True)
        failures = [r for r in started if isinstance(r, BaseException)]
        mine = [LocalReplica(spec, token, *r) for r in started
                if not isinstance(r, BaseException)]
        self.children.extend(mine)
        if failures:
            raise failures[0]
        self._watch = [t for t in self._watch if not t.done()]  # on-demand ones come and go
        for child in mine:
            self._watch.append(asyncio.create_task(self._supervise(child)))
        return mine

    async def _supervise(self, child: LocalReplica) -> None:
        """Restart a child that exits while serving, on its own port."""
        while True:
            code = await child.proc.wait()
            child.forward.cancel()
            if self.stopping or child.retired:
                return
            logger.error("replica %s of %s exited with code %s; restarting it", child.url,
                         child.spec.name, code, extra={
                             "event": "replica_exited", "replica": child.url,
                             "deployment": child.spec.name, "exit_code": code})
            while not self.stopping:
                try:
                    child.proc, url, child.forward = await self.starter(
                        child.spec, child.token, child.port)
                    child.url = url
                    child.restarts += 1
                    break
                except Exception as exc:
                    logger.error("restarting replica %s failed: %s", child.url, exc)
                    await asyncio.sleep(2.0)

    async def stop_children(self, ids: Sequence[str]) -> None:
        """SIGTERM the local children at `ids` (each drains), wait for them to exit (kill
        past the drain timeout) and forget them: an on-demand model's unload."""
        gone = [c for c in self.children if c.url in ids]
        for child in gone:
            child.retired = True
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
        for child in gone:
            try:
                await asyncio.wait_for(child.proc.wait(), self.config.drain_timeout_s + 10.0)
            except TimeoutError:
                child.proc.kill()
                await child.proc.wait()
            child.forward.cancel()
            with contextlib.suppress(ValueError):
                self.children.remove(child)

    def on_demand(self, spec: DeploymentSpec) -> OnDemand:
        """The load state of an on-demand deployment, starting and stopping its local
        children."""
        assert spec.on_demand is not None

        async def start() -> list[tuple[str, MemberClient]]:
            return [(c.url, self._client(spec, c.url, c.token))
                    for c in await self.start_children(spec)]

        return OnDemand(spec.name, spec.on_demand, start, self.stop_children, self.host)

    async def served(self, spec: DeploymentSpec,
                     children: Sequence[LocalReplica] = ()) -> Served:
        """The deployment over its local children and its listed URLs."""
        clients: list[tuple[str, MemberClient]] = []
        for child in children:
            clients.append((child.url, self._client(spec, child.url, child.token)))
        token = self._url_token(spec)
        for url in spec.urls:
            if not is_dns_url(url):
                clients.append((url, self._client(spec, url, token)))
        found = await self._ray_discovery(spec, token) if spec.ray else self._discovery(
            spec, token)
        if found is not None:
            clients.extend(await found.initial())
        served = await build_served(spec, clients, self.cache_dir,
                                    balancer=self.spec.balancer, affinity=self.affinity,
                                    tokenizers=self.tokenizers,
                                    demand=self.on_demand(spec) if spec.on_demand else None)
        if found is not None:
            found.attach(served.pool)
            served.pool.watchers.append(found)
        return served

    def _discovery(self, spec: DeploymentSpec, token: str | None) -> Discovery | None:
        """What finds the replicas of a deployment's `dns+` URLs (None: it lists none)."""
        names = [u for u in spec.urls if is_dns_url(u)]
        if not names:
            return None
        balancer = self.spec.balancer
        try:
            source = dns_source(names, make_resolver(balancer.dns_server))
        except ValueError as exc:
            raise FleetConfigError(f"deployment {spec.name}: {exc}") from None
        return Discovery(source, lambda url: self._client(spec, url, token),
                         interval_s=balancer.discovery_interval_s, what="DNS discovery")

    async def _ray_discovery(self, spec: DeploymentSpec, token: str | None) -> Discovery:
        """Places the deployment's first replicas on Ray unless it has some (`ray_replicas`),
        then finds them through Ray's registry."""
        from tokenyard.cli import ray_replicas

        ray = spec.ray
        assert ray is not None
        if token is None:  # a replica beyond loopback refuses to start without one
            raise FleetConfigError(f"deployment {spec.name}: placement = \"ray\" needs the "
                                   "replica token every gateway shares: set "
                                   "TOKENYARD_REPLICA_TOKEN (or the deployment's token_env)")
        await asyncio.to_thread(ray_replicas.connect, ray)
        command = ray_replicas.replica_command(spec.model, [
            *spec.engine_args, *lora_modules_arg(spec.adapters)],
                                               self.config.drain_timeout_s)
        timeouts = {"start_timeout_s": self.config.replica_start_timeout_s,
                    "discovery_interval_s": self.spec.balancer.discovery_interval_s,
                    "drain_timeout_s": self.config.drain_timeout_s}
        if not ray_replicas.existing(spec.name):
            await ray_replicas.scale(spec.name, ray, ray.replicas, command, token, **timeouts)
        await ray_replicas.serving(spec.name, self.config.replica_start_timeout_s)
        if ray.autoscale is not None:
            from tokenyard.cli import ray_autoscale

            ray_autoscale.start(spec.name, ray, command, token, timeouts)
        return Discovery(lambda: ray_replicas.urls(spec.name),
                         lambda url: self._client(spec, url, token),
                         interval_s=self.spec.balancer.discovery_interval_s,
                         what="Ray discovery")

    def _url_token(self, spec: DeploymentSpec) -> str | None:
        """The bearer token for a deployment's listed URLs. Our own replicas (engine,
        embeddings) share the replica token unless `token_env` names another; an
        upstream is someone else's server: it gets its own key (`token_env`) or none,
        never the replica token, which would let whoever runs it call our replicas."""
        token = spec.token()
        if kind_of(spec).own_replicas:
            return token or self.config.replica_token
        if token is None and spec.token_env:
            logger.warning("upstream %s: %s is not set; its requests go without a key",
                           spec.name, spec.token_env, extra={
                               "event": "upstream_key_missing", "deployment": spec.name,
                               "token_env": spec.token_env})
        return token

    def _client(self, spec: DeploymentSpec, url: str, token: str | None) -> MemberClient:
        return kind_of(spec).client(spec, url, token)

    async def build(self) -> dict[str, Served]:
        """Start every local child, all deployments' at once (each loads its model in its
        own process), then one Served per deployment. An on-demand deployment starts
        none: its first request does."""
        specs = list(self.spec.deployments.values())
        starting = [spec for spec in specs if spec.replicas and not spec.on_demand]
        started = await asyncio.gather(*(self.start_children(spec) for spec in starting),
                                       return_exceptions=True)
        failures = [r for r in started if isinstance(r, BaseException)]
        if failures:  # the children that did start are in self.children: stop() ends them
            raise failures[0]
        children = {spec.name: mine for spec, mine in zip(starting, started, strict=True)
                    if not isinstance(mine, BaseException)}
        out: dict[str, Served] = {}
        for spec in specs:
            if spec.parent is not None:  # a LoRA adapter: its base's replicas
                out[spec.name] = out[spec.parent].adapter(spec)
                continue
            out[spec.name] = await self.served(spec, children.get(spec.name, []))
        return out

    async def stop(self, drain_timeout_s: float) -> None:
        """SIGTERM every child (each drains), then wait; kill what is left."""
        self.stopping = True
        for task in self._watch:
            task.cancel()
        for child in self.children:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
        for child in self.children:
            try:
                await asyncio.wait_for(child.proc.wait(), drain_timeout_s + 10.0)
            except TimeoutError:
                child.proc.kill()
                await child.proc.wait()
            child.forward.cancel()

    def kill(self) -> None:
        for child in self.children:
            if child.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()


async def reload(fleet: FleetBuilder, state: AppState) -> str:
    """Re-read the fleet file and swap the new deployments in without dropping requests:
    unchanged deployments keep their pools; new or changed ones (running URLs and
    upstreams) get new pools; removed ones stop being routed to and drain. A deployment's
    local replica count is fixed at start: a change to it is refused in the log."""
    if fleet.spec.path is None:
        return "no fleet file to reload (serve was started without --config)"
    new = regional_fleet(load_fleet(fleet.spec.path), fleet.config.region)
    deployments: dict[str, Served] = {}
    for name, spec in new.deployments.items():
        if spec.parent is not None:  # a LoRA adapter: its base's replicas, as reloaded
            deployments[name] = deployments[spec.parent].adapter(spec)
            continue
        old = state.deployments.get(name)
        if old is not None and old.spec == spec:
            deployments[name] = old
            continue
        if spec.replicas and not spec.on_demand:
            if old is not None and old.spec.on_demand is None and (
                    old.spec.replicas == spec.replicas):
                children = [c for c in fleet.children if c.spec.name == name]
            elif old is None or old.spec.on_demand is not None:  # (its pool unloads its own)
                children = await fleet.start_children(spec)
            else:
                logger.error("reload: %s changes its local replica count (%d → %d); "
                             "restart serve for that", name, old.spec.replicas, spec.replicas)
                deployments[name] = old
                continue
        else:
            children = []
        deployments[name] = await fleet.served(spec, children)
        deployments[name].pool.start()
    fleet.spec = FleetSpec(deployments={n: s.spec for n, s in deployments.items()},
                           aliases=new.aliases, balancer=fleet.spec.balancer,
                           models=fleet.spec.models, path=fleet.spec.path)
    gone = state.replace_fleet(fleet.spec, deployments)
    for pool in gone:
        state.retired.append(pool)
        task = asyncio.create_task(_retire(state, pool, fleet.config.drain_timeout_s))
        fleet.background.add(task)
        task.add_done_callback(fleet.background.discard)
    summary = (f"reloaded {fleet.spec.path}: {len(deployments)} deployments, "
               f"{len(new.aliases)} aliases, {len(gone)} draining")
    logger.info("%s", summary, extra={
        "event": "reloaded", "file": str(fleet.spec.path), "deployments": sorted(deployments),
        "aliases": sorted(new.aliases), "draining": [pool.name for pool in gone]})
    return summary


async def _retire(state: AppState, pool: Pool, timeout: float) -> None:
    await pool.wait_idle(timeout)
    await pool.close()
    with contextlib.suppress(ValueError):
        state.retired.remove(pool)
