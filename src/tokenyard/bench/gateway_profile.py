"""`tokenyard bench profile --gateway`: where the HTTP gateway process spends its CPU under
a fixed open-loop load against the mock replica.

Starts the mock and ``tokenyard serve --replica-url`` in front of it (defaults on: API
key, limits, billing, ledger, request log; one worker, so the serve process is the HTTP
process), warms it, then sends `--rate` requests/s for `--duration` seconds while a
profiler watches that process:

- py-spy (pinned in the dev extra) samples it from outside (``--nonblocking``: the process
  is never paused), every thread, busy samples only, by function;
- where py-spy is missing or may not attach (ptrace refused), cProfile runs inside the
  serve process instead (``python -m cProfile``) and writes its statistics when serve
  stops; it sees only the main thread (the event loop's), with its own overhead.

Prints the top functions by self time (the function itself) and by inclusive time (it
and what it called), as shares of the samples (py-spy) or of the profiled time (cProfile).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tokenyard.bench.children import Child, start_mock, start_tokenyard
from tokenyard.bench.loadgen import Target, run_load
from tokenyard.bench.mock_core import MOCK_MODEL, MockConfig
from tokenyard.bench.proctree import sample_proc
from tokenyard.bench.stats import summarize
from tokenyard.bench.workloads import LengthDist, synthetic

_LINE = re.compile(r"^(.*) (\d+)$")
_PATH = re.compile(r"\(.*?(?:site-packages|src|lib/python3\.\d+)/")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--gateway` flags of `tokenyard bench profile`."""
    group = parser.add_argument_group("--gateway: the HTTP gateway process under load")
    group.add_argument("--gateway", action="store_true",
                       help="profile the HTTP gateway in front of the mock instead of the engine")
    group.add_argument("--rate", type=float, default=300.0, help="requests/s (300)")
    group.add_argument("--duration", type=float, default=10.0, help="seconds profiled (10)")
    group.add_argument("--stream", action="store_true", help="streamed requests")
    group.add_argument("--top", type=int, default=25, help="functions per table (25)")
    group.add_argument("--profiler", choices=("auto", "py-spy", "cprofile"), default="auto",
                       help="auto: py-spy where it can attach, else cProfile")
    group.add_argument("--raw", type=Path, help="keep py-spy's collapsed stacks here")


def _short(frame: str) -> str:
    return _PATH.sub("(", frame)


def collapsed_tops(text: str, top: int, entry_share: float = 0.85) -> tuple[
        int, list[tuple[str, int]], list[tuple[str, int]]]:
    """From py-spy's collapsed stacks ("f1;f2;f3 count" per line): the samples, and the
    `top` functions by self samples (the stack's last frame) and by inclusive samples
    (every distinct frame of the stack), less the frames on `entry_share` or more of the
    samples (the entry: runpy, the asyncio loop, serve), which say nothing."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        frames, count = m.group(1).split(";"), int(m.group(2))
        total += count
        own[_short(frames[-1])] += count
        for frame in {_short(f) for f in frames}:
            inclusive[frame] += count
    inner = [(f, n) for f, n in inclusive.most_common() if n < entry_share * total]
    return total, own.most_common(top), inner[:top]


def _table(title: str, rows: Sequence[tuple[str, float, float]], unit: str) -> list[str]:
    """A markdown table of (function, share, value) rows under `title`."""
    return [f"\n{title}\n", f"| share | {unit} | function (file) |", "|---|---|---|",
            *(f"| {share:.1%} | {value:.6g} | `{name}` |" for name, share, value in rows)]


def _rows(counts: Sequence[tuple[str, int]], total: int) -> list[tuple[str, float, float]]:
    return [(name, n / max(1, total), n) for name, n in counts]


def py_spy_available() -> str | None:
    """py-spy's path beside this Python, or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


async def _load(target: Target, rate: float, duration_s: float) -> str:
    load = await run_load(target, synthetic(LengthDist(64), LengthDist(16), 7), rate=rate,
                          duration_s=duration_s, seed=7)
    report = summarize(load.records, load.duration_s)
    e2e = report.e2e_ms
    return (f"{report.sent} sent, {report.failed} failed, e2e p50 / p99 "
            + ("-" if e2e is None else f"{e2e.p50:.2f} / {e2e.p99:.2f} ms"))


def _serve(mock: Child, cprofile_out: Path | None, stream: bool) -> tuple[Child, Target]:
    python = ["-m", "cProfile", "-o", str(cprofile_out)] if cprofile_out else []
    child, key = start_tokenyard(mock.url, python=python)
    target = Target(child.url + "/v1", MOCK_MODEL, api_key=key, stream=stream, timeout_s=30.0)
    asyncio.run(run_load(target, synthetic(LengthDist(64), LengthDist(16)), concurrency=2,
                         max_requests=32))
    return child, target


def profile_py_spy(spy: str, args: argparse.Namespace, mock: Child) -> list[str] | None:
    """The tables from py-spy; None where it could not attach."""
    child, target = _serve(mock, None, args.stream)
    raw = args.raw or Path(tempfile.mkdtemp(prefix="tokenyard-profile-")) / "stacks.txt"
    try:
        cpu0 = sample_proc(child.pid)
        spy_proc = subprocess.Popen(
            [spy, "record", "-p", str(child.pid), "-d", str(int(args.duration) + 1), "-r",
             "250", "-f", "raw", "--function", "--nonblocking", "-o", str(raw)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(0.5)
        summary = asyncio.run(_load(target, args.rate, args.duration))
        cpu1 = sample_proc(child.pid)
        out, _ = spy_proc.communicate(timeout=60)
    finally:
        child.stop()
    if spy_proc.returncode != 0 or not raw.exists():
        print(f"py-spy could not profile (exit {spy_proc.returncode}): {out.strip()[-300:]}",
              file=sys.stderr)
        return None
    total, own, inclusive = collapsed_tops(raw.read_text(), args.top)
    sent = int(summary.split()[0])
    cpu_ms = 1000 * (cpu1.cpu_s - cpu0.cpu_s) / max(1, sent)
    return [f"py-spy, {total} busy samples at 250/s (every thread), load: {summary}; the "
            f"process's CPU {cpu_ms:.2f} ms per request (py-spy's sampling included)",
            *_table("Top by self time (samples whose innermost frame is the function)",
                    _rows(own, total), "samples"),
            *_table("Top by inclusive time (samples with the function anywhere on the stack; "
                    "frames on 85 % or more of them, the entry and the loop, left out)",
                    _rows(inclusive, total), "samples")]


def profile_cprofile(args: argparse.Namespace, mock: Child) -> list[str]:
    """The tables from cProfile inside the serve process (its main thread)."""
    out = Path(tempfile.mkdtemp(prefix="tokenyard-profile-")) / "serve.prof"
    child, target = _serve(mock, out, args.stream)
    try:
        summary = asyncio.run(_load(target, args.rate, args.duration))
    finally:
        child.stop(timeout_s=30.0)
    stats = pstats.Stats(str(out))
    # The loop's wait for events (epoll) is idle time, not work: left out of the tables.
    entries = {f: v for f, v in stats.stats.items()  # type: ignore[attr-defined]
               if "poll' of 'select." not in f[2]}
    total = sum(tt for _cc, _nc, tt, _ct, _callers in entries.values()) or 1e-9

    def name(func: tuple[str, int, str]) -> str:
        return _short(f"{func[2]} ({func[0]})")

    by_self = sorted(entries.items(), key=lambda kv: -kv[1][2])[:args.top]
    by_incl = sorted(entries.items(), key=lambda kv: -kv[1][3])[:args.top]
    return [f"cProfile (the main thread, the whole run including start and warm-up: "
            f"{total:.1f} s busy; shares are of that, and a coroutine's cumtime counts each "
            f"resumption, so inclusive shares can pass 100 %), load: {summary}",
            *_table("Top by self time (tottime, s)",
                    [(name(f), v[2] / total, v[2]) for f, v in by_self], "s"),
            *_table("Top by inclusive time (cumtime, s)",
                    [(name(f), v[3] / total, v[3]) for f, v in by_incl], "s")]


def main(args: argparse.Namespace) -> int:
    """Profile the gateway under the fixed load; print the tables."""
    print(f"tokenyard bench profile --gateway: {args.rate:g} req/s "
          f"{'streamed' if args.stream else 'non-stream'} for {args.duration:g} s through "
          f"`tokenyard serve --replica-url` (defaults on) to the mock; 1-minute load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    mock = start_mock(MockConfig(output_len=16, itl_ms=1.0))
    try:
        spy = py_spy_available() if args.profiler != "cprofile" else None
        lines = profile_py_spy(spy, args, mock) if spy else None
        if lines is None:
            if args.profiler == "py-spy":
                return 1
            lines = profile_cprofile(args, mock)
    finally:
        mock.stop()
    print("\n".join(lines))
    return 0
