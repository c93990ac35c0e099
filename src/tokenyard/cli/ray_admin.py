"""`tokenyard admin replicas scale DEPLOYMENT N`: scale a Ray-placed deployment
(`placement = "ray"`) straight on its Ray cluster, within its min_replicas..max_replicas.
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
from pathlib import Path
from typing import Any

from tokenyard.config import ServeConfig, replica_token
from tokenyard.deployments import load_fleet
from tokenyard.fleet_values import FleetConfigError


def add_scale_parser(replicas: Any, fmt: argparse.ArgumentParser) -> None:
    """`replicas scale` under `tokenyard admin`."""
    scale = replicas.add_parser("scale", parents=[fmt],
                                help="scale a Ray-placed deployment to N replicas")
    scale.add_argument("scale_deployment", metavar="DEPLOYMENT")
    scale.add_argument("count", metavar="N", type=int)
    scale.add_argument("--config", type=Path, required=True,
                       help="the fleet file naming the deployment's placement")


async def _scale(args: argparse.Namespace) -> dict[str, Any]:
    from tokenyard.cli import ray_replicas

    fleet = load_fleet(args.config)
    spec = fleet.deployments.get(args.scale_deployment)
    if spec is None or spec.ray is None:
        raise ValueError(f"{args.scale_deployment}: not a deployment of {args.config} "
                         "with placement = \"ray\"")
    spec.ray.check(args.count)
    config = ServeConfig.from_env()
    await asyncio.to_thread(ray_replicas.connect, spec.ray)
    command = ray_replicas.replica_command(spec.model, spec.engine_args,
                                           config.drain_timeout_s)
    indexes = await ray_replicas.scale(
        spec.name, spec.ray, args.count, command, spec.token() or replica_token(),
        start_timeout_s=config.replica_start_timeout_s,
        discovery_interval_s=fleet.balancer.discovery_interval_s,
        drain_timeout_s=config.drain_timeout_s)
    return {"deployment": spec.name, "replicas": len(indexes),
            "urls": await ray_replicas.urls(spec.name)}


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
