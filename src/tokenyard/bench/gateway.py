"""`tokenyard bench gateway`: what tokenyard's HTTP process adds to a request's latency.

Starts a mock replica (`mock_replica.py`) and ``tokenyard serve --replica-url`` in front
of it (with its gateway: API key, limits, billing, ledger, in a scratch state directory;
``--no-auth`` leaves them out), each a subprocess on a free port. Then, at each rate of
`--rates`, it runs the open-loop load generator for `--duration` seconds straight at the
mock's own OpenAI route and through tokenyard, streamed and not. The overhead at a
percentile is the gateway's latency minus the direct latency at that percentile. The
tokenyard process's CPU (% of one core) and RSS come from /proc/<pid>.

The load generator and the mock share the machine's cores with tokenyard; their CPU use is
reported beside its own, since at high rates they compete with it.
"""

from __future__ import annotations

import argparse
import asyncio
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
from collections.abc import Sequence
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


def start_tokenyard(replica_url: str | None, auth: bool = True) -> tuple[Child, str | None]:
    """``tokenyard serve --replica-url`` on a free 127.0.0.1 port (it loads no model; with
    `replica_url` None it starts its own replica of the embedded model), and the API key
    its banner shows (None with `auth` off).

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
           "--drain-timeout", "2", *([] if auth else ["--no-auth"])]
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


def sample_proc(pid: int) -> ProcSample:
    """Read /proc/<pid>/stat and /proc/<pid>/status (Linux)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the command name, which is in parentheses and may hold spaces.
    rest = stat[stat.rindex(")") + 2:].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu_s = (int(rest[11]) + int(rest[12])) / ticks  # utime, stime
    memory = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            memory[key] = int(value.split()[0]) / 1024  # kB
    return ProcSample(time.perf_counter(), cpu_s, memory.get("VmRSS", 0.0),
                      memory.get("VmHWM", 0.0))


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


def cpu_pct_between(a: ProcSample, b: ProcSample) -> float:
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
    client_cpu_pct: float
    mock_cpu_pct: float
    #: Connections the machine dropped for a full accept queue during the run.
    listen_overflows: int = 0
    tokenyard_cpu_pct: float | None = None
    #: tokenyard's CPU time over the run divided by the requests sent (ms).
    tokenyard_cpu_ms_per_request: float | None = None
    tokenyard_rss_mib: float | None = None


@dataclass
class RatePoint:
    """Direct and through tokenyard at one rate and streaming mode, and their difference."""

    rate: float
    stream: bool
    direct: Side
    gateway: Side
    overhead_e2e_ms: dict[str, float] | None
    overhead_ttft_ms: dict[str, float] | None


async def measure_rate(
    direct: Target, gateway: Target, rate: float, stream: bool, *, duration_s: float,
    workload: tuple[int, int], seed: int, mock_pid: int, tokenyard_pid: int,
    progress: bool = False,
) -> RatePoint:
    """One rate and streaming mode: direct to the mock, then through tokenyard."""
    sides: list[Side] = []
    for base in (direct, gateway):
        overflows = listen_overflows()
        before = [sample_proc(mock_pid), sample_proc(tokenyard_pid)]
        load = await run_load(
            replace(base, stream=stream),
            synthetic(LengthDist(workload[0]), LengthDist(workload[1]), seed),
            rate=rate, duration_s=duration_s, seed=seed, progress=progress,
        )
        after = [sample_proc(mock_pid), sample_proc(tokenyard_pid)]
        side = Side(summarize(load.records, load.duration_s), len(load.records) / duration_s,
                    cpu_pct(load.client_cpu_s, load.duration_s),
                    cpu_pct_between(before[0], after[0]), listen_overflows() - overflows)
        if base is gateway:
            side.tokenyard_cpu_pct = cpu_pct_between(before[1], after[1])
            side.tokenyard_cpu_ms_per_request = (
                1000.0 * (after[1].cpu_s - before[1].cpu_s) / max(1, len(load.records)))
            side.tokenyard_rss_mib = after[1].rss_mib
        sides.append(side)
    d, g = sides
    return RatePoint(
        rate, stream, d, g,
        difference(d.report.e2e_ms, g.report.e2e_ms),
        difference(d.report.ttft_ms, g.report.ttft_ms) if stream else None,
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
    add_mock_arguments(parser)


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
    """The results as a markdown table, with the note on shared cores."""
    lines = [
        "| rate req/s | mode | sent/s direct / gw | e2e p50 / p99 ms direct | "
        "e2e p50 / p99 ms gateway | overhead e2e p50 / p99 ms | overhead TTFT p50 / p99 ms | "
        "failed direct / gw | tokenyard CPU % | tokenyard CPU ms/req | tokenyard RSS MiB | "
        "loadgen CPU % | send lag p99 ms | mock CPU % | listen overflows |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        d, g = p.direct, p.gateway
        lines.append(
            f"| {p.rate:g} | {'stream' if p.stream else 'non-stream'} | "
            f"{d.sent_rate:.0f} / {g.sent_rate:.0f} | "
            f"{_pair(d.report.e2e_ms)} | {_pair(g.report.e2e_ms)} | "
            f"{_pair(p.overhead_e2e_ms)} | {_pair(p.overhead_ttft_ms)} | "
            f"{d.report.failed} / {g.report.failed} | {g.tokenyard_cpu_pct or 0:.0f} | "
            f"{g.tokenyard_cpu_ms_per_request or 0:.2f} | "
            f"{g.tokenyard_rss_mib or 0:.0f} | {d.client_cpu_pct:.0f} / {g.client_cpu_pct:.0f} | "
            f"{_lag(d)} / {_lag(g)} | {d.mock_cpu_pct:.0f} / {g.mock_cpu_pct:.0f} | "
            f"{d.listen_overflows} / {g.listen_overflows} |"
        )
    lines += ["", note(cores, load_before)]
    return "\n".join(lines)


def note(cores: int, load_before: float) -> str:
    """The caveat every figure of this harness carries."""
    return (f"Note: the load generator (this process) and the mock replica run on the same "
            f"{cores} cores as tokenyard; CPU % is of one core. Where their CPU use is high, "
            "the figures include their contention with tokenyard; a send lag p99 of more than "
            "a few ms means the generator fell behind its Poisson schedule. Listen "
            "overflows are connections dropped for a full accept queue (the client retries "
            "after ≥ 1 s): where they appear, latency is dominated by them. "
            f"The machine's 1-minute load average before the run: {load_before:.2f}.")


async def run_harness(
    args: argparse.Namespace, mock: Child, tokenyard: Child, api_key: str | None
) -> list[RatePoint]:
    """Every rate and mode against the running mock and tokenyard (called with
    `api_key`; the mock is called with `--api-key`, which it ignores)."""
    workload = (args.input_len, args.output_len)
    direct = Target(mock.url + "/v1", MOCK_MODEL, api_key=args.api_key, timeout_s=args.timeout)
    gateway = Target(tokenyard.url + "/v1", MOCK_MODEL, api_key=api_key,
                     timeout_s=args.timeout)
    await warm_up([direct, gateway], workload)
    progress = not args.quiet and sys.stderr.isatty()
    points = []
    for rate in args.rates:
        for stream in args.modes:
            point = await measure_rate(
                direct, gateway, rate, stream, duration_s=args.duration, workload=workload,
                seed=args.seed, mock_pid=mock.pid, tokenyard_pid=tokenyard.pid,
                progress=progress,
            )
            points.append(point)
            if not args.quiet:
                print(f"rate {rate:g}/s {'stream' if stream else 'non-stream'}: overhead "
                      f"e2e p50/p99 {_pair(point.overhead_e2e_ms)} ms", file=sys.stderr)
    return points


def main(args: argparse.Namespace) -> int:
    """Start the mock and tokenyard, measure, print the table, write JSON if asked."""
    config = config_from_args(args)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = os.getloadavg()[0]
    mock = start_mock(config, args.seed)
    try:
        tokenyard, banner_key = start_tokenyard(mock.url, auth=not args.no_auth)
        try:
            api_key = args.api_key or banner_key
            points = asyncio.run(run_harness(args, mock, tokenyard, api_key))
            peak = sample_proc(tokenyard.pid).peak_rss_mib
        finally:
            tokenyard.stop()
    finally:
        mock.stop()
    cores = os.cpu_count() or 1
    print(render_markdown(points, cores, load_before))
    print(f"tokenyard peak RSS: {peak:.0f} MiB")
    if args.out:
        doc: dict[str, Any] = {
            "config": {
                "rates": args.rates, "duration_s": args.duration,
                "modes": ["stream" if m else "non-stream" for m in args.modes],
                "input_len": args.input_len, "mock": asdict(config), "seed": args.seed,
                "auth": not args.no_auth, "started": started,
            },
            "cores": cores,
            "points": [asdict(p) for p in points],
            "tokenyard_peak_rss_mib": peak,
            "load_average_before": load_before,
            "note": note(cores, load_before),
        }
        args.out.write_text(json.dumps(doc, indent=2))
    return 0
