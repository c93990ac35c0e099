"""`tokenyard bench gateway`: what tokenyard's HTTP process adds to a request's latency.

Starts a mock replica (`mock_replica.py`) and ``tokenyard serve --replica-url`` in front
of it (with its gateway: API key, limits, billing, ledger, in a scratch state directory;
``--no-auth`` leaves them out), each a subprocess on a free port. Then, at each rate of
`--rates`, it runs the open-loop load generator for `--duration` seconds straight at the
mock's own OpenAI route and through tokenyard, streamed and not. The overhead at a
percentile is the gateway's latency minus the direct latency at that percentile.

`--workers 1,2` runs the whole sweep once per worker count (``tokenyard serve --workers
N``, started afresh each time, against the same mock), so the counts sit side by side in
one table; `--telemetry off,traces` does the same for what tokenyard observes (`off`: no
request log lines; `logs`: serve's default JSON line per request; `traces`: that and
OpenTelemetry spans exported to a sink process, `otlp_sink.py`). Metrics are always on.
tokenyard's CPU (% of one core, and ms per request) and RSS are summed over its process
tree, read from /proc before and after each run: the serve parent and every
descendant (its HTTP workers), less the mock and the load generator, which are this
process's own children or itself. Reaped descendants count through their parent's
cutime/cstime, so a worker restarted mid-run loses nothing.

The load generator (this process) and the mock share the machine's cores with tokenyard;
their CPU use is reported beside its own, since at high rates they compete with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tokenyard.bench.children import Child, start_mock, start_otlp_sink, start_tokenyard
from tokenyard.bench.loadgen import Target, run_load
from tokenyard.bench.mock_core import MOCK_MODEL
from tokenyard.bench.mock_replica import add_mock_arguments, config_from_args
from tokenyard.bench.proctree import cpu_pct_between, machine_busy_s, sample_proc, sample_tree
from tokenyard.bench.serve import cpu_pct, float_list
from tokenyard.bench.stats import Distribution, Report, difference, summarize
from tokenyard.bench.workloads import LengthDist, synthetic

WARMUP_REQUESTS = 8
#: `--telemetry` variants: serve's extra flags, and whether spans are exported. `off` only
#: raises serve's log level (no request lines, no info events): serve has no switch for its
#: Prometheus metrics, which the dashboard reads too, so they are on in every variant.
TELEMETRY = {"off": (["--log-level", "warning"], False), "logs": ([], False),
             "traces": ([], True)}
#: The issue's goal for what tokenyard adds at 500 requests/s with 2 workers (ms).
GOAL_P50_MS = 1.0
GOAL_P99_MS = 3.0


# ---------------------------------------------------------------------------- processes


def listen_overflows() -> int:
    """The machine's count of connections dropped because a listening socket's accept
    queue was full (TcpExt ListenOverflows); each such client waits ≥ 1 s to retry."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return 0
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(table.get("ListenOverflows", 0))
    return 0


# ---------------------------------------------------------------------------- measuring


@dataclass
class Side:
    """One target's run at one rate: its report and the CPU use of everyone meanwhile."""

    report: Report
    #: Requests sent per second of the sending window (the offered rate, as achieved).
    sent_rate: float
    #: The load generator's (this process's) CPU during the run, % of one core.
    client_cpu_pct: float
    mock_cpu_pct: float
    #: Connections the machine dropped for a full accept queue during the run.
    listen_overflows: int = 0
    #: Every process's CPU on the machine during the run (others' included), % of one core.
    machine_cpu_pct: float = 0.0
    #: tokenyard's CPU, summed over its process tree (the parent and its workers).
    tokenyard_cpu_pct: float | None = None
    #: tokenyard's CPU time over the run (its whole tree) divided by the requests sent (ms).
    tokenyard_cpu_ms_per_request: float | None = None
    #: The same for the serve parent alone (with workers it only supervises).
    tokenyard_parent_cpu_ms_per_request: float | None = None
    #: RSS summed over the tree at the end of the run.
    tokenyard_rss_mib: float | None = None
    tokenyard_processes: int | None = None


@dataclass
class RatePoint:
    """Direct and through tokenyard at one rate and streaming mode, and their difference."""

    rate: float
    stream: bool
    direct: Side
    gateway: Side
    overhead_e2e_ms: dict[str, float] | None
    overhead_ttft_ms: dict[str, float] | None
    #: tokenyard's HTTP worker processes (``serve --workers``).
    workers: int = 1
    #: What tokenyard observed meanwhile (a `TELEMETRY` variant).
    telemetry: str = "logs"


async def measure_side(
    base: Target, stream: bool, rate: float, *, duration_s: float,
    workload: tuple[int, int], seed: int, mock_pid: int, tree_pid: int | None = None,
    progress: bool = False,
) -> Side:
    """One open-loop run at `rate` against `base`, with everyone's CPU meanwhile; with
    `tree_pid`, the figures of the gateway process tree rooted there (in the `tokenyard_*`
    fields, whichever gateway it is)."""
    outside = (mock_pid, os.getpid())  # never the gateway's, even were they in its tree
    overflows = listen_overflows()
    mock0, busy0 = sample_proc(mock_pid), machine_busy_s()
    tree0 = sample_tree(tree_pid, outside) if tree_pid is not None else None
    t0 = time.monotonic()
    load = await run_load(
        replace(base, stream=stream),
        synthetic(LengthDist(workload[0]), LengthDist(workload[1]), seed),
        rate=rate, duration_s=duration_s, seed=seed, progress=progress,
    )
    mock1, wall = sample_proc(mock_pid), time.monotonic() - t0
    side = Side(summarize(load.records, load.duration_s), len(load.records) / duration_s,
                cpu_pct(load.client_cpu_s, load.duration_s),
                cpu_pct_between(mock0, mock1), listen_overflows() - overflows,
                cpu_pct(machine_busy_s() - busy0, wall))
    if tree_pid is not None and tree0 is not None:
        tree1 = sample_tree(tree_pid, outside)
        sent = max(1, len(load.records))
        side.tokenyard_cpu_pct = cpu_pct_between(tree0, tree1)
        side.tokenyard_cpu_ms_per_request = 1000.0 * (tree1.cpu_s - tree0.cpu_s) / sent
        side.tokenyard_parent_cpu_ms_per_request = (
            1000.0 * (tree1.root_cpu_s - tree0.root_cpu_s) / sent)
        side.tokenyard_rss_mib = tree1.rss_mib
        side.tokenyard_processes = tree1.processes
    return side


async def measure_rate(
    direct: Target, gateway: Target, rate: float, stream: bool, *, duration_s: float,
    workload: tuple[int, int], seed: int, mock_pid: int, tokenyard_pid: int,
    progress: bool = False, workers: int = 1,
) -> RatePoint:
    """One rate and streaming mode: direct to the mock, then through tokenyard (whose
    figures are its process tree's, rooted at `tokenyard_pid`)."""
    d, g = [await measure_side(base, stream, rate, duration_s=duration_s,
                               workload=workload, seed=seed, mock_pid=mock_pid,
                               tree_pid=pid, progress=progress)
            for base, pid in ((direct, None), (gateway, tokenyard_pid))]
    return RatePoint(rate, stream, d, g, difference(d.report.e2e_ms, g.report.e2e_ms),
                     difference(d.report.ttft_ms, g.report.ttft_ms) if stream else None,
                     workers)


async def warm_up(targets: Sequence[Target], workload: tuple[int, int]) -> None:
    """A few requests through each target first (connections, template compile)."""
    for target in targets:
        await run_load(target, synthetic(LengthDist(workload[0]), LengthDist(workload[1])),
                       concurrency=2, max_requests=WARMUP_REQUESTS)


# ---------------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tokenyard bench gateway`."""
    parser.add_argument("--rates", type=float_list, default=[100.0, 500.0, 1000.0],
                        help="open-loop request rates to run, requests/s (100,500,1000)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    parser.add_argument("--modes", type=_modes, default=[True, False],
                        help="stream,non-stream (default both)")
    parser.add_argument("--input-len", type=int, default=64, help="prompt words")
    parser.add_argument("--api-key",
                        help="sent as a bearer token to both targets (default: to tokenyard, "
                             "the development key its banner shows)")
    parser.add_argument("--no-auth", action="store_true",
                        help="serve tokenyard with --no-auth: no keys, limits, billing, ledger")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument("--telemetry", type=_telemetry, default=["logs"],
                        help="off (log level warning: no request lines), logs (serve's default: a "
                             "JSON line per request), traces (logs and OTLP spans to a sink); "
                             "metrics are on in all; a list (off,traces) runs the sweep once "
                             "per variant, side by side (default logs)")
    parser.add_argument("--workers", type=_worker_counts, default=[1],
                        help="tokenyard's HTTP worker processes (serve --workers); a list "
                             "(1,2) runs the sweep once per count, side by side (default 1)")
    add_mock_arguments(parser)


def _worker_counts(text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"workers like 1 or 1,2, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("workers must be >= 1")
    return counts


def _telemetry(text: str) -> list[str]:
    variants = [v.strip() for v in text.split(",") if v.strip()]
    if not variants or any(v not in TELEMETRY for v in variants):
        raise argparse.ArgumentTypeError(f"telemetry variants are {', '.join(TELEMETRY)}")
    return variants


def _modes(text: str) -> list[bool]:
    names = {"stream": True, "non-stream": False}
    modes = [v.strip() for v in text.split(",") if v.strip()]
    if not modes or any(m not in names for m in modes):
        raise argparse.ArgumentTypeError("modes are stream and/or non-stream")
    return [names[m] for m in modes]


def _pair(d: Distribution | dict[str, float] | None) -> str:
    if d is None:
        return "-"
    if isinstance(d, dict):
        return f"{d['p50']:+.2f} / {d['p99']:+.2f}"
    return f"{d.p50:.2f} / {d.p99:.2f}"


def _lag(side: Side) -> str:
    lag = side.report.send_lag_ms
    return "-" if lag is None else f"{lag.p99:.1f}"


def render_markdown(points: Sequence[RatePoint], cores: int, load_before: float) -> str:
    """The results as a markdown table, the worker counts compared where there are several,
    and the note on shared cores."""
    lines = [
        "| workers (telemetry) | rate req/s | mode | sent/s direct / gw | "
        "e2e p50 / p99 ms direct | e2e p50 / p99 ms gateway | overhead e2e p50 / p99 ms | "
        "overhead TTFT p50 / p99 ms | "
        "failed direct / gw | tokenyard CPU % (processes) | tokenyard CPU ms/req "
        "(parent alone) | tokenyard RSS MiB | load generator CPU % direct / gw | "
        "mock CPU % direct / gw | all three CPU % gw | machine CPU % gw (others) | "
        "send lag p99 ms | listen overflows |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        d, g = p.direct, p.gateway
        total = (g.tokenyard_cpu_pct or 0) + g.client_cpu_pct + g.mock_cpu_pct
        lines.append(
            f"| {p.workers} ({p.telemetry}) | {p.rate:g} | "
            f"{'stream' if p.stream else 'non-stream'} | "
            f"{d.sent_rate:.0f} / {g.sent_rate:.0f} | "
            f"{_pair(d.report.e2e_ms)} | {_pair(g.report.e2e_ms)} | "
            f"{_pair(p.overhead_e2e_ms)} | {_pair(p.overhead_ttft_ms)} | "
            f"{d.report.failed} / {g.report.failed} | "
            f"{g.tokenyard_cpu_pct or 0:.0f} ({g.tokenyard_processes or 0}) | "
            f"{g.tokenyard_cpu_ms_per_request or 0:.2f} "
            f"({g.tokenyard_parent_cpu_ms_per_request or 0:.2f}) | "
            f"{g.tokenyard_rss_mib or 0:.0f} | {d.client_cpu_pct:.0f} / {g.client_cpu_pct:.0f} | "
            f"{d.mock_cpu_pct:.0f} / {g.mock_cpu_pct:.0f} | {total:.0f} of {100 * cores} | "
            f"{g.machine_cpu_pct:.0f} ({max(0.0, g.machine_cpu_pct - total):.0f}) | "
            f"{_lag(d)} / {_lag(g)} | {d.listen_overflows} / {g.listen_overflows} |"
        )
    lines += ["", *compare_workers(points), *compare_telemetry(points),
              note(cores, load_before)]
    return "\n".join(lines)


def compare_workers(points: Sequence[RatePoint]) -> list[str]:
    """Where the run has several worker counts: at each rate and mode, the overhead p50 /
    p99 of each count and its ratio to the first count's (lines of markdown, then "")."""
    counts = sorted({p.workers for p in points})
    if len(counts) < 2:
        return []
    lines = ["Worker counts side by side (overhead e2e p50 / p99 ms; the ratio is the "
             f"first count's p50 over each one's; goal at 500 req/s with 2 workers: "
             f"≤ {GOAL_P50_MS:g} / ≤ {GOAL_P99_MS:g}):", ""]
    by_key = {(p.rate, p.stream, p.workers): p for p in points}
    for rate, stream in dict.fromkeys((p.rate, p.stream) for p in points):
        cells = []
        base = by_key.get((rate, stream, counts[0]))
        for n in counts:
            point = by_key.get((rate, stream, n))
            if point is None or point.overhead_e2e_ms is None:
                continue
            cell = f"{n} worker{'s' if n > 1 else ''}: {_pair(point.overhead_e2e_ms)}"
            if base and base.overhead_e2e_ms and point is not base:
                a, b = base.overhead_e2e_ms["p50"], point.overhead_e2e_ms["p50"]
                cell += f" (×{a / b:.2f})" if a > 0 and b > 0 else " (ratio: n/a, p50 ≤ 0)"
            if rate == 500 and n == 2:
                cell += " — goal " + ("met" if goal_met(point.overhead_e2e_ms) else "not met")
            cells.append(cell)
        lines.append(f"- {rate:g} req/s {'stream' if stream else 'non-stream'}: "
                     + "; ".join(cells))
    return [*lines, ""]


def compare_telemetry(points: Sequence[RatePoint]) -> list[str]:
    """Where the run has several telemetry variants: at each worker count, rate and mode,
    each variant's overhead p50 / p99 and its p50 minus the first variant's."""
    variants = list(dict.fromkeys(p.telemetry for p in points))
    if len(variants) < 2:
        return []
    lines = ["Telemetry variants side by side (overhead e2e p50 / p99 ms; in brackets the "
             f"p50 minus {variants[0]}'s):", ""]
    by_key = {(p.workers, p.rate, p.stream, p.telemetry): p for p in points}
    for workers, rate, stream in dict.fromkeys((p.workers, p.rate, p.stream) for p in points):
        base = by_key.get((workers, rate, stream, variants[0]))
        cells = []
        for variant in variants:
            point = by_key.get((workers, rate, stream, variant))
            if point is None or point.overhead_e2e_ms is None:
                continue
            cell = f"{variant}: {_pair(point.overhead_e2e_ms)}"
            if base is not None and base.overhead_e2e_ms and point is not base:
                delta = point.overhead_e2e_ms["p50"] - base.overhead_e2e_ms["p50"]
                cell += f" [{delta:+.3f}]"
            cells.append(cell)
        lines.append(f"- {workers} worker{'s' if workers > 1 else ''}, {rate:g} req/s "
                     f"{'stream' if stream else 'non-stream'}: " + "; ".join(cells))
    return [*lines, ""]


def goal_met(overhead: dict[str, float]) -> bool:
    """The issue's goal for the added latency: ≤ 1 ms p50 and ≤ 3 ms p99."""
    return overhead["p50"] <= GOAL_P50_MS and overhead["p99"] <= GOAL_P99_MS


def note(cores: int, load_before: float) -> str:
    """The caveat every figure of this harness carries."""
    return (f"Note: the load generator (this process) and the mock replica run on the same "
            f"{cores} cores as tokenyard; CPU % is of one core. tokenyard's CPU and RSS are "
            "summed over its process tree (the serve parent and its HTTP workers; the count "
            "in parentheses), its CPU ms/req also for the parent alone; \"all three\" adds "
            "the load generator's and the mock's CPU during the gateway run, against the "
            "cores' total; the machine's CPU is every process's, and in parentheses what "
            "processes outside the benchmark took meanwhile. Where their CPU use is high, "
            "the figures include their contention with tokenyard; a send lag p99 of more than "
            "a few ms means the generator fell behind its Poisson schedule. Listen "
            "overflows are connections dropped for a full accept queue (the client retries "
            "after ≥ 1 s): where they appear, latency is dominated by them. "
            f"The machine's 1-minute load average before the run: {load_before:.2f}.")


async def run_harness(
    args: argparse.Namespace, mock: Child, tokenyard: Child, api_key: str | None,
    workers: int = 1,
) -> list[RatePoint]:
    """Every rate and mode against the running mock and tokenyard (called with
    `api_key`; the mock is called with `--api-key`, which it ignores)."""
    workload = (args.input_len, args.output_len)
    direct = Target(mock.url + "/v1", MOCK_MODEL, api_key=args.api_key, timeout_s=args.timeout)
    gateway = Target(tokenyard.url + "/v1", MOCK_MODEL, api_key=api_key,
                     timeout_s=args.timeout)
    # Each worker gets its own connections (SO_REUSEPORT spreads them): warm all of them.
    await warm_up([direct] + [gateway] * workers, workload)
    progress = not args.quiet and sys.stderr.isatty()
    points = []
    for rate in args.rates:
        for stream in args.modes:
            point = await measure_rate(
                direct, gateway, rate, stream, duration_s=args.duration, workload=workload,
                seed=args.seed, mock_pid=mock.pid, tokenyard_pid=tokenyard.pid,
                progress=progress, workers=workers,
            )
            points.append(point)
            if not args.quiet:
                print(f"workers {workers}, rate {rate:g}/s "
                      f"{'stream' if stream else 'non-stream'}: overhead e2e p50/p99 "
                      f"{_pair(point.overhead_e2e_ms)} ms", file=sys.stderr)
    return points


def run_workers(
    args: argparse.Namespace, mock: Child, workers: int, telemetry: str = "logs",
    sink: Child | None = None,
) -> tuple[list[RatePoint], float]:
    """Start ``tokenyard serve --workers`` in front of `mock`, observing as `telemetry`
    says (spans to `sink`), run every rate and mode, stop it; the points and the tree's
    peak RSS (MiB, each process's peak summed)."""
    flags, traced = TELEMETRY[telemetry]
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url} if traced and sink is not None else {}
    tokenyard, banner_key = start_tokenyard(mock.url, auth=not args.no_auth, workers=workers,
                                            extra=flags, env_extra=env)
    try:
        api_key = args.api_key or banner_key
        points = asyncio.run(run_harness(args, mock, tokenyard, api_key, workers))
        for point in points:
            point.telemetry = telemetry
        peak = sample_tree(tokenyard.pid, (mock.pid, os.getpid())).peak_rss_mib
    finally:
        tokenyard.stop()
    return points, peak


def main(args: argparse.Namespace) -> int:
    """Start the mock and, per worker count, tokenyard; measure, print the table, write
    JSON if asked."""
    config = config_from_args(args)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = os.getloadavg()[0]
    mock = start_mock(config, args.seed)
    sink = start_otlp_sink() if "traces" in args.telemetry else None
    points: list[RatePoint] = []
    peaks: dict[int, float] = {}
    try:
        for workers in args.workers:
            for telemetry in args.telemetry:
                done, peak = run_workers(args, mock, workers, telemetry, sink)
                peaks[workers] = max(peaks.get(workers, 0.0), peak)
                points += done
    finally:
        mock.stop()
        if sink is not None:
            sink.stop()
    cores = os.cpu_count() or 1
    print(render_markdown(points, cores, load_before))
    print("tokenyard peak RSS (its processes' peaks summed): " + ", ".join(
        f"{peak:.0f} MiB with {n} worker{'s' if n > 1 else ''}" for n, peak in peaks.items()))
    if args.out:
        doc: dict[str, Any] = {
            "config": {
                "rates": args.rates, "duration_s": args.duration,
                "modes": ["stream" if m else "non-stream" for m in args.modes],
                "input_len": args.input_len, "mock": asdict(config), "seed": args.seed,
                "auth": not args.no_auth, "workers": args.workers,
                "telemetry": args.telemetry, "started": started,
            },
            "cores": cores,
            "points": [asdict(p) for p in points],
            "tokenyard_peak_rss_mib": max(peaks.values()),
            "tokenyard_peak_rss_mib_by_workers": {str(n): v for n, v in peaks.items()},
            "load_average_before": load_before,
            "note": note(cores, load_before),
        }
        args.out.write_text(json.dumps(doc, indent=2))
    return 0
