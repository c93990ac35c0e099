"""`tokenyard bench ray`: a replica's start time under Ray (`placement = "ray"`). It starts
a local Ray cluster (one head on this machine), then `--rounds` times places one embedded
replica the way a gateway does (`ray_replicas.place`: an actor whose child is `tokenyard
engine`) and times actor created → its replica's first healthy `/healthz`, and inside
that the actor's own figure (replica process started → listening); then kills the actor
and waits until its replica is gone before the next round. `--write` puts the section into
docs/benchmarks.md.

It lives in cli, not bench: it drives `cli/ray_replicas.py` (bench may not import cli).
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tokenyard.placement_spec import RayPlacement
from tokenyard.wire.protocol import HEALTH_PATH

TITLE = "## A replica's start under Ray (`tokenyard bench ray`)"
DEPLOYMENT = "bench-ray"


@dataclass
class Round:
    created_to_healthy_s: float
    process_to_listening_s: float


def _healthy(url: str, timeout_s: float) -> None:
    """Return once `url`'s health route answers 200; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + HEALTH_PATH, timeout=2.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy within {timeout_s:g} s")
        time.sleep(0.02)


def _gone(url: str, timeout_s: float) -> None:
    """Return once nothing answers at `url` any more (the killed actor's replica)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + HEALTH_PATH, timeout=1.0).close()
        except (urllib.error.URLError, OSError):
            return
        time.sleep(0.1)


def one_round(args: argparse.Namespace) -> Round:
    """Place the replica, time it to healthy, take it away."""
    import ray

    from tokenyard.cli import ray_replicas

    placement = RayPlacement(1, 1, 1, num_cpus=0)
    command = ray_replicas.replica_command(None, ["--threads", str(args.threads)], 5.0)
    began = time.monotonic()
    # A replica on the node's address (not loopback) refuses to start without a token.
    token = secrets.token_urlsafe(16)
    actor = ray_replicas.place(DEPLOYMENT, placement, 0, command, token, args.timeout)
    described = ray.get(actor.describe.remote(), timeout=args.timeout)
    _healthy(described["url"], args.timeout)
    took = time.monotonic() - began
    ray.kill(actor, no_restart=True)
    _gone(described["url"], 30.0)
    return Round(took, float(described["start_s"]))


def _spread(values: list[float]) -> str:
    return (f"{statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f}")


def render(rounds: list[Round], cluster_s: float, loads: tuple[float, float],
           command: str) -> str:
    from tokenyard.bench.host import cpu_model

    total = [r.created_to_healthy_s for r in rounds]
    inner = [r.process_to_listening_s for r in rounds]
    ray_part = [t - i for t, i in zip(total, inner, strict=True)]
    return "\n".join([
        TITLE, "",
        "One embedded replica (`tokenyard engine`, the default model) placed as a Ray actor "
        "on a local one-node Ray cluster, the way a gateway places a `placement = \"ray\"` "
        "deployment's replicas (`cli/ray_replicas.py`), then killed; once per round, after "
        "one unmeasured round (Ray's first worker process, the model file's cache). "
        "*Created → healthy*: from the actor's creation to the replica's first 200 on "
        "`/healthz` (what a scale-up or a restart after a node's death waits for). "
        "*Process → listening*: the part inside the actor, from starting the replica "
        "process to its listening line (loading the model). The rest is Ray's: scheduling "
        "the actor, starting its worker process, the registry call.", "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, shared with other sessions; "
        f"1-minute load average {loads[0]:.2f} at the start, {loads[1]:.2f} at the end",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- command: `{command}`",
        f"- the local Ray cluster itself started in {cluster_s:.1f} s (once, not per round)",
        "",
        f"| {len(rounds)} rounds, seconds | median | min | max |",
        "|---|---|---|---|",
        f"| created → healthy | {_spread(total)} |",
        f"| process → listening (inside the actor) | {_spread(inner)} |",
        f"| Ray's part (the difference) | {_spread(ray_part)} |", ""])


def main(args: argparse.Namespace) -> int:
    import ray

    from tokenyard.cli import ray_replicas

    first_load = os.getloadavg()[0]
    began = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, namespace=ray_replicas.NAMESPACE,
             log_to_driver=False)
    try:
        ray_replicas.connect(RayPlacement(1, 1, 1))
        cluster_s = time.monotonic() - began
        one_round(args)  # warm: the first start converts the GGUF into the cache
        rounds = []
        for i in range(args.rounds):
            rounds.append(one_round(args))
            print(f"round {i + 1}: {rounds[-1]}", file=sys.stderr)
    finally:
        ray.shutdown()
    command = "tokenyard " + " ".join(sys.argv[1:])
    report = render(rounds, cluster_s, (first_load, os.getloadavg()[0]), command)
    print(report)
    if args.write:
        from tokenyard.bench.suite import replace_section

        page = args.write.read_text() if args.write.exists() else "# Benchmarks\n"
        args.write.write_text(replace_section(page, report))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="replicas placed and timed")
    parser.add_argument("--threads", type=int, default=1, help="the replica's threads")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one replica may take to become healthy")
    parser.add_argument("--write", type=Path, default=None,
                        help="put the section into this page (docs/benchmarks.md)")
