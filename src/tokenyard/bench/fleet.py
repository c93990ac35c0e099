"""`tokenyard bench fleet`: the balancer's policies side by side on a multi-turn workload.

For each policy (default: `affinity`, `precise`, then `round_robin`), `--replicas` fresh
`tokenyard engine` replicas (one thread each, so each starts with an empty prefix cache;
`precise` routes by their KV-cache events) behind `tokenyard
serve --config` (no gateway: the balancer is the point), and the same seeded multi-turn
workload (`bench/workloads.py`) sent by the load generator (`bench/loadgen.py`) in a
closed loop. Reported per policy: the replicas' prefix-cache hit rate (their own stats:
hit tokens over queried tokens, deltas over the run), TTFT p50 and p99, output tokens
per second, and the p50 of the `balance` stage of `Server-Timing` (the balancer's own
decision). A markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenyard.bench.children import _MOCK_READY, _TOKENYARD_URL, Child, start_child
from tokenyard.bench.loadgen import Target, run_load
from tokenyard.bench.stats import percentile
from tokenyard.bench.workloads import LengthDist, multiturn
from tokenyard.wire.protocol import STATS_PATH

DEPLOYMENT = "bench-fleet"
POLICIES = ("affinity", "precise", "round_robin")
#: The issue's goals: hit rate ≥ 3× round robin's; the decision ≤ 0.2 ms p50.
GOAL_HIT_RATIO = 3.0
GOAL_BALANCE_P50_MS = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated balancer policies to compare (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=40, help="requests per policy")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="requests in flight (closed loop)")
    parser.add_argument("--conversations", type=int, default=5,
                        help="conversations open at once (odd: with 2 replicas, an even "
                        "count would make round robin place every turn of a conversation "
                        "on one replica, as the conversations take turns in order)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--input-len", type=int, default=48, help="words per user turn")
    parser.add_argument("--output-len", type=int, default=8, help="tokens per reply")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="threads per replica")
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas per policy")


@dataclass
class PolicyResult:
    policy: str
    requests: int
    failed: int
    hit_rate: float  # replicas' prefix-cache hit tokens / queried tokens
    ttft_p50_ms: float
    balance_p50_ms: float | None
    duration_s: float
    ttft_p99_ms: float = float("nan")
    output_tok_s: float = 0.0


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenyard.cli", *args]


def _stats(url: str, token: str) -> dict[str, float]:
    request = urllib.request.Request(url + STATS_PATH,
                                     headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _fleet_file(directory: Path, policy: str, urls: Sequence[str]) -> Path:
    path = directory / "fleet.toml"
    listed = ", ".join(f'"{u}"' for u in urls)
    path.write_text(f'[balancer]\npolicy = "{policy}"\n\n'
                    f'[[deployments]]\nname = "{DEPLOYMENT}"\nurls = [{listed}]\n')
    return path


def run_policy(policy: str, args: argparse.Namespace) -> PolicyResult:
    """Fresh replicas and a server for `policy`, the workload, the figures."""
    token = secrets.token_urlsafe(16)
    env = {**os.environ, "TOKENYARD_REPLICA_TOKEN": token}
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="tokenyard-bench-fleet-") as scratch:
        try:
            for _ in range(args.replicas):
                children.append(start_child(
                    _cli("engine", "--host", "127.0.0.1", "--port", "0",
                         "--threads", str(args.threads)), _MOCK_READY, env=env))
            urls = [c.url for c in children]
            config = _fleet_file(Path(scratch), policy, urls)
            server = start_child(
                _cli("serve", "--port", "0", "--no-auth", "--config", str(config)),
                _TOKENYARD_URL, env={**env, "TOKENYARD_STATE_DIR": scratch})
            children.append(server)
            before = [_stats(u, token) for u in urls]
            workload = multiturn(LengthDist(args.input_len), LengthDist(args.output_len),
                                 seed=args.seed, turns=args.turns,
                                 conversations=args.conversations)
            target = Target(server.url + "/v1", DEPLOYMENT, ignore_eos=True)
            result = asyncio.run(run_load(target, workload, concurrency=args.concurrency,
                                          max_requests=args.requests))
            after = [_stats(u, token) for u in urls]
        finally:
            for child in reversed(children):
                child.stop()
    queries = sum(a["prefix_cache_queries"] - b["prefix_cache_queries"]
                  for a, b in zip(after, before, strict=True))
    hits = sum(a["prefix_cache_hits"] - b["prefix_cache_hits"]
               for a, b in zip(after, before, strict=True))
    ok = [r for r in result.records if r.ok]
    balance = [r.server_timing_ms["balance"] for r in ok if "balance" in r.server_timing_ms]
    ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    return PolicyResult(
        policy, len(result.records), len(result.records) - len(ok),
        hits / queries if queries else 0.0,
        percentile(ttfts, 50) if ttfts else float("nan"),
        percentile(balance, 50) if balance else None, result.duration_s,
        percentile(ttfts, 99) if ttfts else float("nan"),
        sum(r.output_tokens or 0 for r in ok) / result.duration_s if result.duration_s else 0.0)


def table(results: Sequence[PolicyResult]) -> str:
    lines = ["| policy | requests (failed) | prefix-cache hit rate "
             "| TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | `balance` p50 (ms) | run (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        balance = f"{r.balance_p50_ms:.3f}" if r.balance_p50_ms is not None else "–"
        lines.append(f"| {r.policy} | {r.requests} ({r.failed}) | {r.hit_rate:.1%} | "
                     f"{r.ttft_p50_ms:.1f} | {r.ttft_p99_ms:.1f} | {r.output_tok_s:.1f} | "
                     f"{balance} | "
                     f"{r.duration_s:.1f} |")
    by = {r.policy: r for r in results}
    rr = by.get("round_robin")
    for name in ("affinity", "precise"):
        if name in by and rr is not None:
            a = by[name]
            ratio = a.hit_rate / rr.hit_rate if rr.hit_rate else float("inf")
            lines += ["", f"{name.capitalize()}'s hit rate is {ratio:.2f}× round robin's "
                          f"(goal ≥ {GOAL_HIT_RATIO:g}×); its TTFT p50 is "
                          f"{a.ttft_p50_ms / rr.ttft_p50_ms:.2f}× round robin's (goal < 1)."]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    results = [run_policy(p, args) for p in policies]
    print(f"Multi-turn workload ({args.conversations} conversations of {args.turns} turns, "
          f"{args.input_len} words per user turn, {args.output_len} tokens per reply), "
          f"{args.requests} requests per policy, {args.concurrency} in flight, over "
          f"{args.replicas} replicas (`--threads {args.threads}` each), fresh for each policy.\n")
    print(table(results))
    return 0 if all(r.failed == 0 for r in results) else 1
