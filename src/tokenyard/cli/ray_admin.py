"""Scaling a Ray-placed deployment (`placement = "ray"`) within its
min_replicas..max_replicas, one code path for both ways in: `scale_deployment`.

- `tokenyard admin replicas scale DEPLOYMENT N --config FLEET` calls it straight on the
  deployment's Ray cluster (no gateway needed);
- a gateway serving the deployment calls it for `POST /admin/v1/deployments/{name}/replicas`
  through `RayScaler` (`api/replica_scaling.py` checks the request first).

New replicas are awaited until they serve; the ones taken away drain first (they leave
Ray's registry, every gateway has a discovery round to stop sending them work, their
running requests end), so no request is lost.

    tokenyard admin replicas scale smollm2-135m-instruct-2026-11-22 3 --config fleet.toml
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenyard.config import ServeConfig, replica_token
from tokenyard.deployments import DeploymentSpec, FleetSpec, load_fleet
from tokenyard.fleet_values import FleetConfigError


def add_scale_parser(replicas: Any, fmt: argparse.ArgumentParser) -> None:
    """`replicas scale` under `tokenyard admin`."""
    scale = replicas.add_parser("scale", parents=[fmt],
                                help="scale a Ray-placed deployment to N replicas")
    scale.add_argument("scale_deployment", metavar="DEPLOYMENT")
    scale.add_argument("count", metavar="N", type=int)
    scale.add_argument("--config", type=Path, required=True,
                       help="the fleet file naming the deployment's placement")


async def scale_deployment(spec: DeploymentSpec, count: int, config: ServeConfig,
                           discovery_interval_s: float) -> list[dict[str, str]]:
    """Scale `spec` (placed by Ray) to `count` replicas, on a worker thread (its Ray calls
    block: a gateway's event loop goes on serving); its live replicas after."""
    from tokenyard.cli import ray_replicas

    assert spec.ray is not None
    spec.ray.check(count)
    placement = spec.ray

    async def scaled() -> list[dict[str, str]]:
        await asyncio.to_thread(ray_replicas.connect, placement)
        command = ray_replicas.replica_command(spec.model, spec.engine_args,
                                               config.drain_timeout_s)
        await ray_replicas.scale(
            spec.name, placement, count, command,
            spec.token() or config.replica_token or replica_token(),
            start_timeout_s=config.replica_start_timeout_s,
            discovery_interval_s=discovery_interval_s,
            drain_timeout_s=config.drain_timeout_s)
        return await live_replicas(spec)

    return await asyncio.to_thread(asyncio.run, scaled())


async def live_replicas(spec: DeploymentSpec) -> list[dict[str, str]]:
    """The deployment's replicas in Ray's registry: actor name and URL, by name."""
    from tokenyard.cli import ray_replicas

    assert spec.ray is not None
    await asyncio.to_thread(ray_replicas.connect, spec.ray)
    found = await ray_replicas.listing(spec.name)
    return [{"name": name, "url": found[name]} for name in sorted(found)]


@dataclass
class RayScaler:
    """What a gateway's admin route scales with (`api.context.ReplicaScaler`): one scale
    at a time per deployment, a later one waiting for the one before."""

    config: ServeConfig
    discovery_interval_s: float
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    async def scale(self, spec: DeploymentSpec, count: int) -> list[dict[str, str]]:
        async with self.locks.setdefault(spec.name, asyncio.Lock()):
            return await scale_deployment(spec, count, self.config,
                                          self.discovery_interval_s)

    async def replicas(self, spec: DeploymentSpec) -> list[dict[str, str]]:
        return await live_replicas(spec)


def ray_scaler(fleet: FleetSpec, config: ServeConfig) -> RayScaler | None:
    """The scaler of a gateway serving `fleet`; None when no deployment is placed by Ray."""
    if not any(spec.ray is not None for spec in fleet.deployments.values()):
        return None
    return RayScaler(config, fleet.balancer.discovery_interval_s)


async def _scale(args: argparse.Namespace) -> dict[str, Any]:
    fleet = load_fleet(args.config)
    spec = fleet.deployments.get(args.scale_deployment)
    if spec is None or spec.ray is None:
        raise ValueError(f"{args.scale_deployment}: not a deployment of {args.config} "
                         "with placement = \"ray\"")
    spec.ray.check(args.count)
    found = await scale_deployment(spec, args.count, ServeConfig.from_env(),
                                   fleet.balancer.discovery_interval_s)
    return {"deployment": spec.name, "replicas": len(found),
            "urls": sorted(r["url"] for r in found)}


def run_scale(args: argparse.Namespace) -> int:
    """Scale; 2 with the reason on a refusal (no such deployment, out of range, no Ray)."""
    try:
        result = asyncio.run(_scale(args))
    except ImportError:
        print("error: Ray is not installed (pip install 'tokenyard[ray]')", file=sys.stderr)
        return 2
    except (FleetConfigError, ValueError, RuntimeError, ConnectionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['deployment']}: {result['replicas']} replica(s)")
        for url in result["urls"]:
            print(f"  {url}")
    return 0
