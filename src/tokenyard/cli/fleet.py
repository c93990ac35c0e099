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

    def __post_init__(self) -> None:
        # A regional endpoint (`serve --region R`) builds, serves and lists only R's.
        self.spec = regional_fleet(self.spec, self.config.region)

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
        for child in mine:
            self._watch.append(asyncio.create_task(self._supervise(child)))
        return mine

    async def _supervise(self, child: LocalReplica) -> None:
        """Restart a child that exits while serving, on its own port."""
        while True:
            code = await child.proc.wait()
            child.forward.cancel()
            if self.stopping:
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
                                    tokenizers=self.tokenizers)
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
        """Start every local child, then one Served per deployment."""
        out: dict[str, Served] = {}
        for spec in self.spec.deployments.values():
            if spec.parent is not None:  # a LoRA adapter: its base's replicas
                out[spec.name] = out[spec.parent].adapter(spec)
                continue
            children = await self.start_children(spec) if spec.replicas else []
            out[spec.name] = await self.served(spec, children)
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
        if spec.replicas:
            if old is not None and old.spec.replicas == spec.replicas:
                children = [c for c in fleet.children if c.spec.name == name]
            elif old is None:
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
                           path=fleet.spec.path)
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
