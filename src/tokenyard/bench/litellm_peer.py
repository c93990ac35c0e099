"""tokenyard beside LiteLLM's proxy, both gateways in front of the same mock (`make
bench-peers`, or `tokenyard bench peers --peers litellm` alone).

LiteLLM is installed from PyPI, pinned (`LITELLM_VERSION`), into a virtual environment of
its own under ``<cache>/peers/`` (as `llama_build.py` caches llama-server), so nothing of it
touches tokenyard's environment; where it cannot install, the section says why and the
run goes on without it. Its proxy runs with one worker and a master key (it refuses to
start without one; tokenyard runs with its defaults, API key and all).

One mock replica (`mock_replica.py`: 16 tokens 1 ms apart) serves both gateways, one run
at a time. At each rate and mode the open-loop client of `tokenyard bench gateway` sends
straight to the mock, then through each gateway in turn, the order flipping from one
point to the next and from one round to the next, so a machine that slows down hurts
both alike. What a gateway adds is its latency minus the direct latency of the same round
at that percentile; its CPU per request and RSS are its process tree's. A gateway that
fails more than `FAIL_SHARE` of its requests or adds more than `SATURATED_MS` at p50 is
saturated there: its higher rates in that mode are not run (they would only queue).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tokenyard.bench.children import (
    Child,
    free_port,
    start_child,
    start_mock,
    start_tokenyard,
)
from tokenyard.bench.gateway import Side, measure_side
from tokenyard.bench.host import OtherLoad, cpu_model
from tokenyard.bench.litellm_table import LITELLM, TOKENYARD, Point, render_section
from tokenyard.bench.llama_build import peers_dir
from tokenyard.bench.loadgen import Target, run_load
from tokenyard.bench.mock_core import MOCK_MODEL, MockConfig
from tokenyard.bench.proctree import sample_tree
from tokenyard.bench.serve import float_list
from tokenyard.bench.stats import difference
from tokenyard.bench.workloads import LengthDist, synthetic

LITELLM_VERSION = "1.106.12"
#: The proxy's master key: a local benchmark's, on 127.0.0.1 only.
MASTER_KEY = "sk-bench-4f1c9a7e2b5d8c3f6a0e9b7d1c4f8a2e"
FAIL_SHARE = 0.01
#: Added p50 beyond which a gateway counts as saturated: a queue building up (tokenyard
#: adds a few ms, LiteLLM tens below its saturation).
SATURATED_MS = 100.0
_CONFIG = """model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {mock}/v1
      api_key: unused
general_settings:
  master_key: {key}
litellm_settings:
  telemetry: false
"""


class Unavailable(RuntimeError):
    """LiteLLM could not be installed or started here; the message says why."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The LiteLLM comparison's flags of `tokenyard bench peers`."""
    parser.add_argument("--litellm-rates", type=float_list,
                        default=[10.0, 50.0, 100.0, 300.0, 500.0],
                        help="open-loop rates, requests/s (10,50,100,300,500)")
    parser.add_argument("--litellm-duration", type=float, default=10.0,
                        help="seconds per run of the LiteLLM comparison")
    parser.add_argument("--litellm-rounds", type=int, default=2,
                        help="alternating rounds of the LiteLLM comparison")


def litellm_dir(cache_dir: Path) -> Path:
    """LiteLLM's own virtual environment in the cache."""
    return peers_dir(cache_dir) / f"litellm-{LITELLM_VERSION}"


def ensure_litellm(cache_dir: Path, say: Callable[[str], None]) -> Path:
    """The `litellm` proxy command, installed first if the cache has none. Raises
    Unavailable with the installer's last words where pip fails."""
    root = litellm_dir(cache_dir)
    command, stamp = root / "bin" / "litellm", root / ".installed"
    if stamp.exists() and command.exists():
        return command
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    log = root.parent / f"litellm-{LITELLM_VERSION}-install.log"
    say(f"installing litellm[proxy]=={LITELLM_VERSION} into {root} (log: {log})")
    with log.open("w") as out:
        for cmd in ([sys.executable, "-m", "venv", str(root)],
                    [str(root / "bin" / "pip"), "install", "-q",
                     f"litellm[proxy]=={LITELLM_VERSION}"]):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                shutil.rmtree(root, ignore_errors=True)
                tail = " ".join(log.read_text().strip().splitlines()[-3:])[-400:]
                raise Unavailable(f"`{' '.join(cmd[-2:])}` failed: {tail}")
    stamp.write_text(LITELLM_VERSION + "\n")
    return command


def start_litellm(command: Path, mock_url: str, port: int) -> Child:
    """The proxy (one worker) in front of `mock_url` on `port`; answering once returned."""
    scratch = Path(tempfile.mkdtemp(prefix="tokenyard-bench-litellm-"))
    config = scratch / "config.yaml"
    config.write_text(_CONFIG.format(model=MOCK_MODEL, mock=mock_url, key=MASTER_KEY))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DATABASE_", "LITELLM_", "OTEL_", "TOKENYARD_"))}
    # No download of the model price map; only errors on the console.
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR")
    try:
        child = start_child([str(command), "--config", str(config), "--host", "127.0.0.1",
                             "--port", str(port), "--num_workers", "1", "--telemetry",
                             "False"], re.compile(r"(Proxy initialized)"), env=env)
    except RuntimeError as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        raise Unavailable(str(exc)[-600:]) from None
    child.scratch, child.url = scratch, f"http://127.0.0.1:{port}"
    return child


async def _answering(target: Target) -> None:
    """Wait for `target` to answer a chat request (60 s at most), then warm it."""
    for _ in range(600):
        load = await run_load(target, synthetic(LengthDist(8), LengthDist(4)),
                              concurrency=1, max_requests=1)
        if load.records[0].ok:
            break
        await asyncio.sleep(0.1)
    else:
        raise Unavailable(f"{target.url} never answered: {load.records[0].error_detail}")
    await run_load(target, synthetic(LengthDist(64), LengthDist(16)), concurrency=2,
                   max_requests=16)


def _settle(pid: int, limit_s: float = 20.0) -> None:
    """Wait until the tree at `pid` is nearly idle (a saturated gateway still working
    off requests its clients gave up on would tax the next run)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        a = sample_tree(pid)
        time.sleep(0.5)
        b = sample_tree(pid)
        if (b.cpu_s - a.cpu_s) / max(1e-6, b.at - a.at) < 0.1:
            return


@dataclass
class Run:
    """Every point measured, and where each gateway saturated per mode."""

    points: list[Point] = field(default_factory=list)
    saturated: dict[tuple[str, bool], float] = field(default_factory=dict)


def _saturated(side: Side, added_p50: float | None) -> bool:
    report = side.report
    return (report.failed > FAIL_SHARE * max(1, report.sent)
            or added_p50 is None or added_p50 > SATURATED_MS)


async def _round(run: Run, r: int, targets: dict[str, tuple[Target, int]], direct: Target,
                 mock: Child, args: argparse.Namespace) -> None:
    """One round: every mode and rate, direct and through each gateway, order flipping."""
    i = 0
    for stream in (False, True):
        for rate in args.litellm_rates:
            common = {"duration_s": args.litellm_duration, "workload": (64, 16),
                      "seed": 1000 * r + i, "mock_pid": mock.pid}
            d = await measure_side(direct, stream, rate, **common)
            order = list(targets) if (r + i) % 2 == 0 else list(targets)[::-1]
            i += 1
            for name in order:
                if rate > run.saturated.get((name, stream), float("inf")):
                    continue
                target, pid = targets[name]
                side = await measure_side(target, stream, rate, tree_pid=pid, **common)
                added = difference(d.report.e2e_ms, side.report.e2e_ms)
                point = Point(name, r, rate, stream, d, side, added)
                run.points.append(point)
                print(f"round {r + 1} {name} {rate:g}/s {'stream' if stream else 'non-stream'}"
                      f": added p50 {added['p50'] if added else float('nan'):+.2f} ms, "
                      f"{side.report.failed}/{side.report.sent} failed, CPU "
                      f"{side.tokenyard_cpu_ms_per_request or 0:.2f} ms/req", file=sys.stderr)
                if _saturated(side, added["p50"] if added else None):
                    key = (name, stream)
                    run.saturated[key] = min(rate, run.saturated.get(key, rate))
                _settle(pid)


def measure(args: argparse.Namespace, command: Path, say: Callable[[str], None]) -> str:
    """Start the mock and both gateways, run the rounds, stop them; the page section."""
    mock = start_mock(MockConfig(output_len=16, itl_ms=1.0))
    children: list[Child] = [mock]
    load_before, others, started = os.getloadavg()[0], OtherLoad(), time.monotonic()
    run = Run()
    try:
        ours, key = start_tokenyard(mock.url)
        children.append(ours)
        theirs = start_litellm(command, mock.url, free_port())
        children.append(theirs)
        timeout = 15.0
        targets = {
            TOKENYARD: (Target(ours.url + "/v1", MOCK_MODEL, api_key=key, timeout_s=timeout),
                        ours.pid),
            LITELLM: (Target(theirs.url + "/v1", MOCK_MODEL, api_key=MASTER_KEY,
                             timeout_s=timeout), theirs.pid)}
        direct = Target(mock.url + "/v1", MOCK_MODEL, timeout_s=timeout)
        for target, _ in targets.values():
            asyncio.run(_answering(target))
        for r in range(args.litellm_rounds):
            say(f"LiteLLM comparison, round {r + 1} of {args.litellm_rounds}")
            asyncio.run(_round(run, r, targets, direct, mock, args))
    finally:
        for child in reversed(children):
            child.stop()
    measured_s = time.monotonic() - started
    share = others.share(measured_s)
    setup = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores; 1-minute load average "
                   f"{load_before:.2f} before; other processes took "
                   + ("an unknown share" if share is None else f"{share:.1%}")
                   + " of the CPU over the whole run",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rounds": args.litellm_rounds, "duration_s": args.litellm_duration,
        "measured_s": measured_s, "version": LITELLM_VERSION,
        "rates": args.litellm_rates, "saturated": run.saturated,
    }
    return render_section(run.points, setup)


def main(args: argparse.Namespace, say: Callable[[str], None]) -> str:
    """The page section: measured, or saying why LiteLLM could not be measured here."""
    from tokenyard.config import default_cache_dir

    try:
        command = ensure_litellm(default_cache_dir(), say)
        return measure(args, command, say)
    except (Unavailable, aiohttp.ClientError) as exc:
        say(f"LiteLLM skipped: {exc}")
        return render_section([], {"skipped": str(exc), "version": LITELLM_VERSION})

