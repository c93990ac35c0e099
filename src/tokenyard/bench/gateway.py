"""`tokenyard bench gateway`: what tokenyard's HTTP process adds to a request's latency.

Starts a mock replica (`mock_replica.py`) and ``tokenyard serve --replica-url`` in front
of it (with its gateway: API key, limits, billing, ledger, in a scratch state directory;
``--no-auth`` leaves them out), each a subprocess on a free port. Then, at each rate of
`--rates`, it runs the open-loop load generator for `--duration` seconds straight at the
mock's own OpenAI route and through tokenyard, streamed and not. The overhead at a
percentile is the gateway's latency minus the direct latency at that percentile.

`--workers 1,2` runs the whole sweep once per worker count (``tokenyard serve --workers
N``, started afresh each time, against the same mock), so the counts sit side by side in
one table. tokenyard's CPU (% of one core, and ms per request) and RSS are summed over its
process tree, read from /proc before and after each run: the serve parent and every
descendant (its HTTP workers), less the mock and the load generator, which are this
process's own children or itself. Reaped descendants count through their parent's
cutime/cstime, so a worker restarted mid-run loses nothing.

The load generator (this process) and the mock share the machine's cores with tokenyard;
their CPU use is reported beside its own, since at high rates they compete with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenyard.bench.loadgen import Target, run_load
from tokenyard.bench.mock_replica import (
    MOCK_MODEL,
    MockConfig,
    add_mock_arguments,
    config_from_args,
)
from tokenyard.bench.serve import cpu_pct, float_list
from tokenyard.bench.stats import Distribution, Report, difference, summarize
from tokenyard.bench.workloads import LengthDist, synthetic

START_TIMEOUT_S = 120.0
_MOCK_READY = re.compile(r"serving at (http://\S+)")
_TOKENYARD_URL = re.compile(r"tokenyard serving \S+ at (http://\S+)")
#: The last banner line `tokenyard serve` prints that the harness needs (the key is above).
_TOKENYARD_READY = re.compile(r"replica: (http://\S+)")
_API_KEY = re.compile(r"API key: (\S+)")
WARMUP_REQUESTS = 8
#: The issue's goal for what tokenyard adds at 500 requests/s with 2 workers (ms).
GOAL_P50_MS = 1.0
GOAL_P99_MS = 3.0


# ---------------------------------------------------------------------------- processes


@dataclass
class Child:
    """A subprocess serving HTTP at `url`; its recent output lines are kept in `lines`."""

    proc: subprocess.Popen[str]
    url: str
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    #: Removed when the process is stopped (tokenyard's state directory).
    scratch: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def search(self, pattern: re.Pattern[str]) -> str | None:
        """The first group of the first output line matching `pattern`."""
        for line in list(self.lines):
            if m := pattern.search(line):
                return m.group(1)
        return None

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit code."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    return self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            return self.proc.wait()
        finally:
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)


def start_child(
    cmd: Sequence[str],
    ready: re.Pattern[str],
    url: re.Pattern[str] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> Child:
    """Start `cmd` (stdout and stderr merged) and wait for a line matching `ready`; the
    URL it serves is the first group of `url` (default: of `ready`) in its output so far.
    A thread keeps draining its output afterwards. `env` replaces the environment.

    Raises RuntimeError with the output's tail if it exits or times out first.
    """
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**(env or os.environ), "PYTHONUNBUFFERED": "1"})
    lines: deque[str] = deque(maxlen=200)
    event = threading.Event()

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if ready.search(line):
                event.set()
        event.set()  # it ended: let the caller see that

    threading.Thread(target=drain, daemon=True).start()
    event.wait(timeout_s)
    child = Child(proc, "", lines)
    found = child.search(url or ready)
    if proc.poll() is not None or found is None:
        child.stop(timeout_s=1.0)
        raise RuntimeError(f"{' '.join(cmd[:5])} did not start:\n" + "".join(list(lines)[-30:]))
    child.url = found
    return child


def start_mock(config: MockConfig, seed: int = 0) -> Child:
    """The mock replica on a free 127.0.0.1 port."""
    c = config
    return start_child([
        sys.executable, "-m", "tokenyard.bench.mock_replica", "--port", "0",
        "--output-len", str(c.output_len), "--ttft-ms", str(c.ttft_ms), "--itl-ms",
        str(c.itl_ms), "--inject-429", str(c.inject_429), "--inject-503", str(c.inject_503),
        "--inject-500", str(c.inject_500), "--inject-stream-error",
        str(c.inject_stream_error), "--seed", str(seed),
    ], _MOCK_READY)


def start_tokenyard(
    replica_url: str | None, auth: bool = True, *, workers: int = 1, embeddings: bool = False,
    extra: Sequence[str] = (),
) -> tuple[Child, str | None]:
    """``tokenyard serve --replica-url`` on a free 127.0.0.1 port (it loads no model; with
    `replica_url` None it starts its own replica of the embedded model), and the API key
    its banner shows (None with `auth` off). `workers`: its HTTP worker processes
    (``--workers``); `embeddings`: start the embeddings pool too (no benchmark calls it);
    `extra`: more serve flags (e.g. ``--config FILE``).

    It gets a state directory of its own (its SQLite store, ledger journal and development
    key, removed when it stops) and neither TOKENYARD_DATABASE_URL nor TOKENYARD_REDIS_URL:
    a benchmark never writes to a real store.
    """
    scratch = Path(tempfile.mkdtemp(prefix="tokenyard-bench-"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("TOKENYARD_DATABASE_URL", "TOKENYARD_REDIS_URL")}
    env["TOKENYARD_STATE_DIR"] = str(scratch)
    replica = ["--replica-url", replica_url] if replica_url else []
    cmd = [sys.executable, "-m", "tokenyard.cli", "serve", *replica, "--port", "0",
           "--drain-timeout", "2", "--workers", str(workers),
           *([] if auth else ["--no-auth"]), *([] if embeddings else ["--no-embeddings"]),
           *extra]
    try:
        child = start_child(cmd, _TOKENYARD_READY, _TOKENYARD_URL, env)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    child.scratch = scratch
    return child, child.search(_API_KEY)


@dataclass(frozen=True)
class ProcSample:
    """A process's CPU time (user + system, s) and resident memory (MiB) at one moment."""

    at: float
    cpu_s: float
    rss_mib: float
    peak_rss_mib: float


def _stat(pid: int) -> list[int]:
    """utime, stime, cutime, cstime of /proc/<pid>/stat, in clock ticks."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the command name, which is in parentheses and may hold spaces.
    rest = stat[stat.rindex(")") + 2:].split()
    return [int(v) for v in rest[11:15]]


def _memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of /proc/<pid>/status, MiB (0 for a zombie)."""
    memory = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            memory[key] = int(value.split()[0]) / 1024  # kB
    return memory.get("VmRSS", 0.0), memory.get("VmHWM", 0.0)


def sample_proc(pid: int) -> ProcSample:
    """Read /proc/<pid>/stat and /proc/<pid>/status (Linux)."""
    utime, stime, _, _ = _stat(pid)
    rss, peak = _memory_mib(pid)
    return ProcSample(time.perf_counter(), (utime + stime) / os.sysconf("SC_CLK_TCK"), rss,
                      peak)


def child_pids(pid: int) -> list[int]:
    """`pid`'s children: /proc/<pid>/task/*/children (each thread's), or a scan of every
    process's parent where the kernel lacks those files; [] once it has exited."""
    tasks = Path(f"/proc/{pid}/task")
    if (tasks / str(pid) / "children").exists():
        found: list[int] = []
        for task in tasks.iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
        return found
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def tree_pids(root: int, exclude: Collection[int] = ()) -> list[int]:
    """`root` and all its descendants, less each pid in `exclude` and its subtree."""
    out: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in exclude or pid in out:
            continue
        out.append(pid)
        todo += child_pids(pid)
    return out


@dataclass(frozen=True)
class TreeSample:
    """A process tree's CPU time (s) and resident memory (MiB) at one moment, summed over
    its processes; `root_cpu_s` is the root's own CPU time alone."""

    at: float
    cpu_s: float
    root_cpu_s: float
    rss_mib: float
    peak_rss_mib: float
    processes: int


def sample_tree(root: int, exclude: Collection[int] = ()) -> TreeSample:
    """Sum /proc's figures over `tree_pids(root, exclude)`. Each process counts its own
    CPU time and its reaped children's (cutime, cstime), so a descendant that exited
    between two samples still counts. A process that exits while it is read is skipped.
    RSS is summed per process (pages shared between them count once per process)."""
    cpu = root_ticks = processes = 0
    rss = peak = 0.0
    for pid in tree_pids(root, exclude):
        try:
            times = _stat(pid)
            memory = _memory_mib(pid)
        except (OSError, ValueError, IndexError):
            continue
        cpu += sum(times)
        if pid == root:
            root_ticks = times[0] + times[1]
        rss, peak, processes = rss + memory[0], peak + memory[1], processes + 1
    ticks = os.sysconf("SC_CLK_TCK")
    return TreeSample(time.perf_counter(), cpu / ticks, root_ticks / ticks, rss, peak,
                      processes)


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


def machine_busy_s() -> float:
    """CPU time the whole machine spent busy (all cores, not idle nor iowait), from
    /proc/stat, in seconds; 0 where it cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(v) for v in fields]
    except (OSError, ValueError):
        return 0.0
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]  # user..steal, less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def cpu_pct_between(a: ProcSample | TreeSample, b: ProcSample | TreeSample) -> float:
    """CPU use between two samples, in % of one core."""
    wall = b.at - a.at
    return 100.0 * (b.cpu_s - a.cpu_s) / wall if wall > 0 else 0.0


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


async def measure_rate(
    direct: Target, gateway: Target, rate: float, stream: bool, *, duration_s: float,
    workload: tuple[int, int], seed: int, mock_pid: int, tokenyard_pid: int,
    progress: bool = False, workers: int = 1,
) -> RatePoint:
    """One rate and streaming mode: direct to the mock, then through tokenyard (whose
    figures are its process tree's, rooted at `tokenyard_pid`)."""
    sides: list[Side] = []
    outside = (mock_pid, os.getpid())  # never tokenyard's, even were they in its tree
    for base in (direct, gateway):
        overflows = listen_overflows()
        mock0, tree0 = sample_proc(mock_pid), sample_tree(tokenyard_pid, outside)
        busy0 = machine_busy_s()
        load = await run_load(
            replace(base, stream=stream),
            synthetic(LengthDist(workload[0]), LengthDist(workload[1]), seed),
            rate=rate, duration_s=duration_s, seed=seed, progress=progress,
        )
        mock1, tree1 = sample_proc(mock_pid), sample_tree(tokenyard_pid, outside)
        side = Side(summarize(load.records, load.duration_s), len(load.records) / duration_s,
                    cpu_pct(load.client_cpu_s, load.duration_s),
                    cpu_pct_between(mock0, mock1), listen_overflows() - overflows,
                    cpu_pct(machine_busy_s() - busy0, tree1.at - tree0.at))
        if base is gateway:
            sent = max(1, len(load.records))
            side.tokenyard_cpu_pct = cpu_pct_between(tree0, tree1)
            side.tokenyard_cpu_ms_per_request = 1000.0 * (tree1.cpu_s - tree0.cpu_s) / sent
            side.tokenyard_parent_cpu_ms_per_request = (
                1000.0 * (tree1.root_cpu_s - tree0.root_cpu_s) / sent)
            side.tokenyard_rss_mib = tree1.rss_mib
            side.tokenyard_processes = tree1.processes
        sides.append(side)
    d, g = sides
    return RatePoint(
        rate, stream, d, g,
        difference(d.report.e2e_ms, g.report.e2e_ms),
        difference(d.report.ttft_ms, g.report.ttft_ms) if stream else None,
        workers,
    )


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
        "| workers | rate req/s | mode | sent/s direct / gw | e2e p50 / p99 ms direct | "
        "e2e p50 / p99 ms gateway | overhead e2e p50 / p99 ms | overhead TTFT p50 / p99 ms | "
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
            f"| {p.workers} | {p.rate:g} | {'stream' if p.stream else 'non-stream'} | "
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
    lines += ["", *compare_workers(points), note(cores, load_before)]
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


def run_workers(args: argparse.Namespace, mock: Child, workers: int) -> tuple[
        list[RatePoint], float]:
    """Start ``tokenyard serve --workers`` in front of `mock`, run every rate and mode,
    stop it; the points and the tree's peak RSS (MiB, each process's peak summed)."""
    tokenyard, banner_key = start_tokenyard(mock.url, auth=not args.no_auth, workers=workers)
    try:
        api_key = args.api_key or banner_key
        points = asyncio.run(run_harness(args, mock, tokenyard, api_key, workers))
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
    points: list[RatePoint] = []
    peaks: dict[int, float] = {}
    try:
        for workers in args.workers:
            done, peaks[workers] = run_workers(args, mock, workers)
            points += done
    finally:
        mock.stop()
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
                "auth": not args.no_auth, "workers": args.workers, "started": started,
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
