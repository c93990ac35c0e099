"""`tokenyard bench fleet`: the balancer's policies side by side on a multi-tenant workload.

For each policy (default: `precise`, `affinity` (the default policy), `least` and
`round_robin`), `--replicas` fresh `tokenyard engine` replicas (one thread and a small KV
pool each, `--kv-cache-gib`, so each starts empty and evicts under load; `precise` routes by
their KV-cache events) behind `tokenyard serve --config` with its gateway on: `--orgs`
orgs, each with an API key of its own (`bench/tenants.py`, made with `tokenyard admin`),
its own long system prompt and several multi-turn conversations, some of which go idle
for a while; the gateway salts each org's prefix blocks with its org. Each org's requests
go in a closed loop of their own, all orgs at once. The policies run in turn, `--rounds`
times, in an order that alternates between rounds.

Reported per policy, as the median over the rounds with the min and max: the replicas'
prefix-cache hit rate (their own stats: hit tokens over queried tokens, deltas over the
run), TTFT p50 and p99, output tokens per second, and the p50 of the `balance` stage of
`Server-Timing` (the balancer's own decision); then the ratios against the goals, and
the `balance` stage with the precise index at 100,000 blocks (`bench/fleet_decision.py`,
in process). Also: the workload's live set (system prompts and open conversations, from
the requests' usage) against one replica's KV pool and the fleet's, on which the hit-rate
ratios depend, and per policy where its misses come from (first turns, what later turns
could have hit and missed, the replicas' evictions: `bench/fleet_profile.py`). Markdown
tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenyard.bench import fleet_decision, fleet_profile
from tokenyard.bench.children import _MOCK_READY, _TOKENYARD_URL, Child, start_child
from tokenyard.bench.loadgen import LoadResult, Target, run_load
from tokenyard.bench.stats import percentile
from tokenyard.bench.tenants import Tenant, TenantShape, create_tenants, tenant_conversations
from tokenyard.config import EngineConfig
from tokenyard.wire.protocol import STATS_PATH

DEPLOYMENT = "bench-fleet"
#: The issue's four policies.
POLICIES = ("precise", "affinity", "least", "round_robin")
#: The policy a fleet file gets when it names none (`deployments.BalancerSpec`).
DEFAULT_POLICY = "affinity"
#: The issue's goals, against round robin: hit rate ≥ 3×, TTFT p50 ≤ 0.6×; and the
#: decision ≤ 0.2 ms p50 at 100,000 indexed blocks.
GOAL_HIT_RATIO = 3.0
GOAL_TTFT_RATIO = 0.6
GOAL_BALANCE_P50_MS = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated balancer policies to compare (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of every policy, in alternating order (default 2)")
    parser.add_argument("--requests", type=int, default=80,
                        help="requests per policy and round, split evenly over the orgs")
    parser.add_argument("--orgs", type=int, default=5,
                        help="tenants, each with its own key (default 5: a count sharing no "
                        "factor with --replicas; else round robin, as the orgs take turns "
                        "in step, would send each org to the same replica every time)")
    parser.add_argument("--in-flight", type=int, default=1,
                        help="requests in flight per org (closed loop)")
    parser.add_argument("--conversations", type=int, default=3,
                        help="conversations open at once per org")
    parser.add_argument("--turns", type=int, default=8, help="turns per conversation")
    parser.add_argument("--system-len", type=int, default=384,
                        help="words in each org's system prompt")
    parser.add_argument("--input-len", type=int, default=24, help="words per user turn")
    parser.add_argument("--output-len", type=int, default=8, help="tokens per reply")
    parser.add_argument("--idle-p", type=float, default=0.25,
                        help="chance that a conversation goes idle after a turn")
    parser.add_argument("--idle-for", type=int, default=6,
                        help="the org's requests an idle conversation sits out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="threads per replica")
    parser.add_argument("--replicas", type=int, default=4, help="engine replicas per policy")
    parser.add_argument("--kv-cache-gib", type=float, default=0.055,
                        help="each replica's KV pool (default: 80 blocks of 16 tokens with "
                        "the embedded model, which the default workload's live set "
                        "overflows about 3× and the 4 replicas' pools together hold)")
    parser.add_argument("--index-blocks", type=int, default=100_000,
                        help="indexed blocks for the decision-time table (0: skip it)")
    parser.add_argument("--decisions", type=int, default=2000,
                        help="decisions per round in the decision-time table")
    parser.add_argument("--write", type=Path,
                        help="also replace this page's balancer section with the report "
                        "(what `bench suite --only fleet` writes; docs/benchmarks.md)")


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
    profile: fleet_profile.MissProfile | None = None
    #: Each replica's KV pool, in blocks (its stats).
    pool_blocks: int = 0


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


def _shape(args: argparse.Namespace) -> TenantShape:
    return TenantShape(args.system_len, args.input_len, args.output_len, args.turns,
                       args.conversations, args.idle_p, args.idle_for)


def _org_seed(args: argparse.Namespace, org: int) -> int:
    return args.seed * 1000 + org


async def _load(url: str, tenants: Sequence[Tenant],
                args: argparse.Namespace) -> list[LoadResult]:
    """Every org's closed loop at once, each with its key and its conversations; each
    org's result."""
    per_org = max(1, args.requests // len(tenants))
    shape = _shape(args)
    return list(await asyncio.gather(*(
        run_load(Target(url + "/v1", DEPLOYMENT, api_key=t.api_key, ignore_eos=True),
                 tenant_conversations(shape, seed=_org_seed(args, i)),
                 concurrency=args.in_flight, max_requests=per_org)
        for i, t in enumerate(tenants))))


def _miss_profile(policy: str, per_org: Sequence[LoadResult], args: argparse.Namespace,
                  evicted: int) -> fleet_profile.MissProfile | None:
    """Where the misses come from (`bench/fleet_profile.py`); None unless each org's
    records are its requests in order (one in flight per org)."""
    if args.in_flight != 1:
        return None
    shape = _shape(args)
    return fleet_profile.profile(
        policy, [(tenant_conversations(shape, seed=_org_seed(args, i)), r.records)
                 for i, r in enumerate(per_org)],
        EngineConfig().block_size, args.turns, evicted)


def run_policy(policy: str, args: argparse.Namespace, state_dir: Path,
               tenants: Sequence[Tenant]) -> PolicyResult:
    """Fresh replicas and a server for `policy` (on `state_dir`'s store, which holds the
    `tenants`), the workload, the figures."""
    token = secrets.token_urlsafe(16)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TOKENYARD_DATABASE_URL", "TOKENYARD_REDIS_URL")
           and not k.startswith("OTEL_")}
    env["TOKENYARD_REPLICA_TOKEN"] = token
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="tokenyard-bench-fleet-") as scratch:
        try:
            engine = _cli("engine", "--host", "127.0.0.1", "--port", "0", "--threads",
                          str(args.threads), "--kv-cache-gib", str(args.kv_cache_gib))
            # One at a time: started together on a busy 2-core machine, a replica's
            # model load outlasted the start timeout.
            for _ in range(args.replicas):
                children.append(start_child(engine, _MOCK_READY, env=env))
            urls = [c.url for c in children]
            config = _fleet_file(Path(scratch), policy, urls)
            # The load generator is one address: the edge's per-address limits are off.
            server = start_child(
                _cli("serve", "--port", "0", "--config", str(config), "--no-embeddings",
                     "--edge-requests-per-s", "0", "--edge-connections-per-address", "0",
                     "--log-format", "text"),
                _TOKENYARD_URL, env={**env, "TOKENYARD_STATE_DIR": str(state_dir)})
            children.append(server)
            before = [_stats(u, token) for u in urls]
            per_org = asyncio.run(_load(server.url, tenants, args))
            after = [_stats(u, token) for u in urls]
        finally:
            for child in reversed(children):
                child.stop()

    def delta(name: str) -> int:
        return int(sum(a.get(name, 0) - b.get(name, 0)
                       for a, b in zip(after, before, strict=True)))

    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    result = LoadResult([r for o in per_org for r in o.records],
                        max(o.duration_s for o in per_org), sum(o.client_cpu_s for o in per_org))
    ok = [r for r in result.records if r.ok]
    failed = [r for r in result.records if not r.ok]
    if failed:
        print(f"{policy}: {len(failed)} failed, e.g. {failed[0].error}: "
              f"{failed[0].error_detail}", file=sys.stderr)
    balance = [r.server_timing_ms["balance"] for r in ok if "balance" in r.server_timing_ms]
    ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    return PolicyResult(
        policy, len(result.records), len(failed),
        hits / queries if queries else 0.0,
        percentile(ttfts, 50) if ttfts else float("nan"),
        percentile(balance, 50) if balance else None, result.duration_s,
        percentile(ttfts, 99) if ttfts else float("nan"),
        sum(r.output_tokens or 0 for r in ok) / result.duration_s if result.duration_s else 0.0,
        _miss_profile(policy, per_org, args, delta("num_evicted_kv_blocks")),
        int(after[0]["num_kv_blocks"]))


def _spread(values: Sequence[float], fmt: str) -> str:
    """Median (min–max) of the rounds' values."""
    xs = sorted(values)
    return f"{format(percentile(xs, 50), fmt)} ({format(xs[0], fmt)}–{format(xs[-1], fmt)})"


def _median(values: Sequence[float]) -> float:
    return percentile(sorted(values), 50)


def table(results: Sequence[PolicyResult]) -> str:
    """One row per policy: each figure's median over the rounds (min–max), then each
    other policy's ratios to round robin and to the default policy."""
    by: dict[str, list[PolicyResult]] = {}
    for r in results:
        by.setdefault(r.policy, []).append(r)
    lines = ["| policy | requests (failed) | prefix-cache hit rate | TTFT p50 (ms) "
             "| TTFT p99 (ms) | output tok/s | `balance` p50 (ms) | run (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, rs in by.items():
        balances = [r.balance_p50_ms for r in rs if r.balance_p50_ms is not None]
        lines.append(
            f"| {name} | {sum(r.requests for r in rs)} ({sum(r.failed for r in rs)}) "
            f"| {_spread([100 * r.hit_rate for r in rs], '.1f')} % "
            f"| {_spread([r.ttft_p50_ms for r in rs], '.0f')} "
            f"| {_spread([r.ttft_p99_ms for r in rs], '.0f')} "
            f"| {_spread([r.output_tok_s for r in rs], '.1f')} "
            f"| {_spread(balances, '.3f') if balances else '–'} "
            f"| {_spread([r.duration_s for r in rs], '.1f')} |")
    lines += ["", "| policy | against | hit rate | TTFT p50 |", "|---|---|---|---|"]
    for name, rs in by.items():
        for base in ("round_robin", DEFAULT_POLICY):
            if base == name or base not in by:
                continue
            hit = _median([r.hit_rate for r in rs])
            base_hit = _median([r.hit_rate for r in by[base]])
            ttft = _median([r.ttft_p50_ms for r in rs])
            base_ttft = _median([r.ttft_p50_ms for r in by[base]])
            ratio = f"{hit / base_hit:.2f}×" if base_hit else "∞"
            lines.append(f"| {name} | {base} | {ratio} | {ttft / base_ttft:.2f}× |")
    lines += ["", f"Ratios of the medians. Goals (issue 25), precise against round robin: "
                  f"hit rate ≥ {GOAL_HIT_RATIO:g}×, TTFT p50 ≤ {GOAL_TTFT_RATIO:g}×."]
    return "\n".join(lines)


def _working_set(results: Sequence[PolicyResult], args: argparse.Namespace) -> str:
    """The workload's live set against one replica's KV pool and the fleet's."""
    block = EngineConfig().block_size
    pool = max((r.pool_blocks for r in results), default=0) * block
    profiles = [r.profile for r in results if r.profile is not None]
    live = fleet_profile.working_set_tokens(profiles)
    if not pool or not live:
        return ""
    return (f"Working set: the orgs' system prompts and open conversations come to "
            f"{live:,.0f} tokens on average over the runs (each org's mean, from the "
            f"requests' usage), against {pool:,} tokens in each replica's KV pool "
            f"({pool // block} blocks of {block}): {live / pool:.2f}× one replica's pool, "
            f"{live / (pool * args.replicas):.2f}× the {args.replicas} replicas' together. "
            f"Round robin sends every org to every replica, so each replica needs the whole "
            f"working set to hit; a policy that keeps each org on a replica needs its share "
            f"of it there. The ratio of their hit rates therefore depends on this ratio of "
            f"working set to pool: with a working set that fits one replica's pool, round "
            f"robin ends up caching everything everywhere and differs only on conversation "
            f"history; past the fleet's pools together, every policy evicts.")


def main(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.orgs < 1 or args.rounds < 1 or args.replicas < 1:
        raise SystemExit("--orgs, --rounds and --replicas must be at least 1")
    load = os.getloadavg()[0]
    results: list[PolicyResult] = []
    state_dir = Path(tempfile.mkdtemp(prefix="tokenyard-bench-fleet-state-"))
    try:
        tenants = create_tenants(state_dir, args.orgs)
        for round_ in range(args.rounds):
            order = policies if round_ % 2 == 0 else policies[::-1]
            for policy in order:
                results.append(run_policy(policy, args, state_dir, tenants))
                print(f"round {round_ + 1}: {results[-1]}", file=sys.stderr)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    s = _shape(args)
    parts = [
        f"Multi-tenant workload: {args.orgs} orgs, each with its own API key and a "
        f"{s.system_len}-word system prompt, {s.conversations} conversations open per org "
        f"({s.turns} turns, {s.input_len} words per user turn, {s.output_len} tokens per "
        f"reply; after a turn a conversation goes idle for {s.idle_for} of its org's "
        f"requests with chance {s.idle_p:g}), {args.in_flight} request(s) in flight per "
        f"org; {args.requests} requests per policy and round over {args.replicas} replicas "
        f"(`--threads {args.threads}`, `--kv-cache-gib {args.kv_cache_gib:g}` each), fresh "
        f"for each run; {args.rounds} rounds, the policies' order alternating. Median "
        f"(min–max) over the rounds.", _working_set(results, args), table(results)]
    profiles = [r.profile for r in results if r.profile is not None]
    if profiles:
        parts += ["Where the misses come from (`bench/fleet_profile.py`; each policy's rounds "
                  "summed, from each request's usage):", fleet_profile.table(profiles)]
    if args.index_blocks:
        rounds = [fleet_decision.measure(args.index_blocks, args.replicas,
                                         decisions=args.decisions, seed=args.seed + i)
                  for i in range(args.rounds)]
        parts += ["The `precise` decision alone, in process: `Pool.acquire` over a synthetic "
                  "index (`bench/fleet_decision.py`).",
                  fleet_decision.table(rounds, GOAL_BALANCE_P50_MS)]
    report = "\n\n".join(p for p in parts if p)
    print(report)
    if args.write:
        from tokenyard.bench.suite import fleet_section, replace_section

        section = fleet_section(report, load)
        page = args.write.read_text() if args.write.exists() else "# Benchmarks\n"
        args.write.write_text(replace_section(page, section))
    return 0 if all(r.failed == 0 for r in results) else 1
