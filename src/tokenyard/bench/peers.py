"""`tokenyard bench peers` (what `make bench-peers` runs): tokenyard beside llama.cpp's
`llama-server` on the same GGUF file, one side-by-side table with ratios; then the
gateway beside LiteLLM's proxy in front of the same mock (`litellm_peer.py`). `--peers`
picks either.

Both servers get the same requests from the same client as `tokenyard bench serve`
(streamed OpenAI chat, ``ignore_eos``), one server at a time and alternating: each round
runs every phase on one server, then on the other, and the next round starts with the
other one, so a machine that slows down during the run hurts both alike. The table shows
min / median / max over the rounds (at least `MIN_ROUNDS` of them by default) and the ratio
of the medians tokenyard / llama-server, with the range of the per-round ratios beside it.

Phases: one stream (short prompts), one ~1,000-token prompt and the same prompt again
(the prefix cache), then 8 and then 32 streams at once, during which the server's process
tree is sampled for its resident memory. `llama-server` runs with ``-t 2 -np N
--cont-batching`` (N the phase's concurrency, so it is restarted per phase);
`tokenyard serve --no-auth --threads 2` once per round, with llama-server's KV cache: float16
elements and a pool of the bytes llama-server's largest context takes (`tokenyard_kv_flags`).
Besides each server's whole tree, the RSS of the process that holds the model is sampled
alone (tokenyard's engine replica; llama-server itself).

`--model` picks the GGUF: the embedded SmolLM2-135M (the default), a model of SmolLM2-1.7B's
shape with random weights (``1.7b``: built once by `bench_model.py`, Q4_1; ``1.7b-q4_0`` and
``1.7b-q8_0`` too), or a path. Before the rounds the machine's memory bandwidth is measured,
and the section reports both servers' one-stream decode against the roofline it allows for
the model (`roofline.py`). The 1.7B model gets its own page section and smaller phases
(`PLAN_1_7B`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tokenyard.bench import litellm_peer, roofline
from tokenyard.bench.bench_model import (
    MODEL_CHOICES,
    describe,
    ensure_bench_model,
    model_quant,
)
from tokenyard.bench.children import Child, free_port, start_child, start_tokenyard
from tokenyard.bench.host import OtherLoad, cpu_model
from tokenyard.bench.litellm_table import PAGE_SECTION as LITELLM_SECTION
from tokenyard.bench.llama_build import LLAMA_CPP_PYTHON, ensure_llama_server
from tokenyard.bench.loadgen import Target, list_models, run_load
from tokenyard.bench.peers_table import (
    PAGE_SECTION,
    PAGE_SECTION_1_7B,
    render_section,
    write_section,
)
from tokenyard.bench.proctree import child_pids, sample_tree
from tokenyard.bench.stats import summarize
from tokenyard.bench.workloads import LengthDist, RequestSpec, synthetic
from tokenyard.config import default_cache_dir
from tokenyard.text.model_files import embedded_model_path

SERVERS = ("llama-server", "tokenyard")
#: Fewer alternating rounds than this and one lucky round can move a median: the default,
#: and the budget never stops a run short of it.
MIN_ROUNDS = 5
_LLAMA_READY = re.compile(r"listening on (http://\S+)")
#: How long a server may take to load the model and listen: the 1.7B model's ~1 GB of
#: blocks on a shared machine take minutes (the start helpers' default is 2).
LOAD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Plan:
    """What one round sends: prompt and output lengths and request counts per phase."""

    short_input: int = 45
    long_input: int = 1000
    output: int = 128
    long_output: int = 16
    one_stream_requests: int = 3
    requests_8: int = 16
    requests_32: int = 32
    #: A phase stops sending after this many seconds (those in flight still finish).
    phase_cap_s: float = 60.0
    #: Alternating rounds when `--rounds` is not given.
    rounds: int = MIN_ROUNDS


QUICK = Plan(short_input=45, long_input=300, output=32, long_output=8, one_stream_requests=2,
             requests_8=8, requests_32=32, phase_cap_s=30.0, rounds=1)
#: The 1.7B model on two cores: ~13x the embedded model's bytes and FLOPs a token, so fewer
#: and shorter requests (one request per stream at 32); still `MIN_ROUNDS` rounds, about an
#: hour on two cores (llama-server's 32 streams take most of a round).
PLAN_1_7B = Plan(short_input=45, long_input=1000, output=32, long_output=4,
                 one_stream_requests=2, requests_8=8, requests_32=32, phase_cap_s=60.0)


@dataclass
class PhaseRun:
    """One phase on one server in one round: its figures and what failed."""

    figures: dict[str, float] = field(default_factory=dict)
    sent: int = 0
    failed: int = 0
    retried: int = 0
    failures: dict[str, str] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tokenyard bench peers`."""
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"alternating rounds (each: every phase on each server; default "
                             f"{MIN_ROUNDS})")
    parser.add_argument("--model", default="embedded",
                        help=f"the GGUF both servers load: {', '.join(MODEL_CHOICES)} (1.7b: "
                             "SmolLM2-1.7B's shape, random weights, Q4_1; built once into "
                             "the cache) or a path")
    parser.add_argument("--budget-min", type=float, default=15.0,
                        help=f"start no new round after this many minutes of measuring, "
                             f"once {MIN_ROUNDS} rounds (or --rounds, if fewer) are done")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: one round of short phases")
    parser.add_argument("--write", type=Path, default=Path("docs/benchmarks.md"),
                        help="the page whose peers section is rewritten")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--json", type=Path, help="write every round's figures here")
    parser.add_argument("--threads", type=int, default=2, help="each server's threads")
    parser.add_argument("--build-jobs", type=int, default=2, help="parallel compile jobs")
    parser.add_argument("--peers", type=_peers, default=list(PEERS),
                        help="which comparisons: llama-server, litellm or both (default)")
    litellm_peer.add_arguments(parser)


#: The comparisons `--peers` names.
PEERS = ("llama-server", "litellm")


def _peers(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or any(n not in PEERS for n in names):
        raise argparse.ArgumentTypeError(f"peers are {', '.join(PEERS)}")
    return names


def llama_context(slots: int) -> int:
    """`-c` for `slots` sequences: what a phase needs (2,048 tokens for the one slot that
    takes the long prompt, 512 each for short prompts). Without it llama-server gives every
    slot the model's whole 8,192, and its KV cache alone is 6 GB at 32 slots."""
    return 2048 if slots == 1 else 512 * slots


def start_llama(binary: Path, model: Path, slots: int, threads: int) -> Child:
    """`llama-server` on a free port with `slots` parallel sequences; ready once it logs
    the address it listens on, which it does after loading the model."""
    return start_child([
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(free_port()),
        "-t", str(threads), "-np", str(slots), "-c", str(llama_context(slots)),
        "--cont-batching",
    ], _LLAMA_READY, timeout_s=LOAD_TIMEOUT_S)


def tokenyard_kv_flags(model: Path) -> list[str]:
    """Serve flags giving tokenyard llama-server's KV cache: float16 elements (its default
    type) and the bytes its largest context (`llama_context(32)` tokens) takes."""
    import torch

    from tokenyard.engine.core import kv_block_bytes
    from tokenyard.engine.models.gguf_loader import open_gguf, read_gguf_config

    per_token = kv_block_bytes(read_gguf_config(open_gguf(model)), 1, torch.float16)
    gib = per_token * llama_context(32) / 2**30
    return ["--kv-cache-dtype", "float16", "--kv-cache-gib", f"{gib:.4f}"]


def engine_pid(root: int) -> int:
    """The process holding the model: `tokenyard serve`'s engine replica child, else the
    server itself (llama-server)."""
    for pid in child_pids(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"engine" in argv:
            return pid
    return root


class RssPeak:
    """The largest summed RSS (MiB) of a process tree, and of the process in it holding
    the model (`engine_pid`), sampled by a thread meanwhile."""

    def __init__(self, pid: int, every_s: float = 0.25) -> None:
        self.pid, self.every_s, self.peak_mib = pid, every_s, 0.0
        self.engine_peak_mib = 0.0
        self._engine = engine_pid(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, sample_tree(self.pid).rss_mib)
            self.engine_peak_mib = max(self.engine_peak_mib,
                                       sample_tree(self._engine).rss_mib)
            self._stop.wait(self.every_s)

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _repeat(spec: RequestSpec) -> Iterator[RequestSpec]:
    while True:
        yield spec


async def _phase(target: Target, workload: Iterator[RequestSpec], concurrency: int,
                 requests: int, cap_s: float | None) -> tuple[PhaseRun, Any]:
    """Run one closed-loop phase; its PhaseRun (counts filled) and its Report."""
    load = await run_load(target, workload, concurrency=concurrency, max_requests=requests,
                          duration_s=cap_s)
    report = summarize(load.records, load.duration_s)
    run = PhaseRun(sent=report.sent, failed=report.failed, retried=load.retried,
                   failures={k: f"{n}× {report.failure_examples.get(k, '')}"[:160]
                             for k, n in report.failures.items()})
    return run, (report, load)


async def one_stream(target: Target, plan: Plan, seed: int) -> dict[str, PhaseRun]:
    """One stream of short prompts; then a long prompt and the same prompt again."""
    short, out = LengthDist(plan.short_input), LengthDist(plan.output)
    run, (report, _) = await _phase(target, synthetic(short, out, seed), 1,
                                    plan.one_stream_requests, plan.phase_cap_s)
    if report.tpot_ms is not None:
        run.figures["decode_tok_s"] = 1000.0 / report.tpot_ms.p50
    if report.ttft_ms is not None:
        run.figures["ttft_short_ms"] = report.ttft_ms.p50
    long_spec = next(synthetic(LengthDist(plan.long_input), LengthDist(plan.long_output),
                               seed + 1))
    again, (_, load) = await _phase(target, _repeat(long_spec), 1, 2, None)
    for name, record in zip(("ttft_long_ms", "ttft_again_ms"), load.records, strict=False):
        if record.ok and record.ttft_s is not None:
            again.figures[name] = record.ttft_s * 1000.0
    return {"one stream": run, "long prompt, twice": again}


async def many_streams(target: Target, plan: Plan, seed: int, concurrency: int,
                       pid: int) -> PhaseRun:
    """`concurrency` streams at once, the server's RSS sampled meanwhile."""
    requests = plan.requests_8 if concurrency <= 8 else plan.requests_32
    workload = synthetic(LengthDist(plan.short_input), LengthDist(plan.output), seed)
    with RssPeak(pid) as rss:
        run, (report, _) = await _phase(target, workload, concurrency, requests,
                                        plan.phase_cap_s)
    run.figures[f"agg_{concurrency}_tok_s"] = report.output_token_rate
    if report.ttft_ms is not None:
        run.figures[f"ttft_{concurrency}_p50_ms"] = report.ttft_ms.p50
        run.figures[f"ttft_{concurrency}_p99_ms"] = report.ttft_ms.p99
    run.figures[f"rss_{concurrency}_mib"] = rss.peak_mib
    run.figures[f"rss_{concurrency}_engine_mib"] = rss.engine_peak_mib
    return run


async def _target(child: Child) -> Target:
    """A streaming chat target for the server `child`, after one unmeasured request."""
    base = child.url.rstrip("/") + "/v1"
    for _ in range(600):  # llama-server answers 503 while it warms up
        try:
            models = await list_models(base)
            break
        except (aiohttp.ClientError, ValueError):
            await asyncio.sleep(0.1)
    else:
        raise RuntimeError(f"{base}/models never answered")
    target = Target(base, models[0] if models else "default", ignore_eos=True)
    warm = synthetic(LengthDist(8), LengthDist(4), seed=999_999)
    await run_load(target, warm, concurrency=1, max_requests=1)
    return target


def tokenyard_flags(model: Path, threads: int) -> list[str]:
    """`tokenyard serve`'s flags in this benchmark."""
    return ["--model", str(model), "--threads", str(threads), *tokenyard_kv_flags(model)]


def run_server(name: str, binary: Path | None, model: Path, plan: Plan, seed: int,
               threads: int) -> dict[str, PhaseRun]:
    """Every phase on server `name` (llama-server restarted per phase for its -np)."""
    phases: dict[str, PhaseRun] = {}
    if name == "tokenyard":
        child, _ = start_tokenyard(None, auth=False, extra=tokenyard_flags(model, threads),
                                   start_timeout_s=LOAD_TIMEOUT_S)
        try:
            target = asyncio.run(_target(child))
            phases.update(asyncio.run(one_stream(target, plan, seed)))
            for c in (8, 32):
                phases[f"{c} streams"] = asyncio.run(
                    many_streams(target, plan, seed + 10 * c, c, child.pid))
        finally:
            child.stop()
        return phases
    assert binary is not None
    for c in (1, 8, 32):
        child = start_llama(binary, model, c, threads)
        try:
            target = asyncio.run(_target(child))
            if c == 1:
                phases.update(asyncio.run(one_stream(target, plan, seed)))
            else:
                phases[f"{c} streams"] = asyncio.run(
                    many_streams(target, plan, seed + 10 * c, c, child.pid))
        finally:
            child.stop()
    return phases


def medians(rounds: Sequence[dict[str, dict[str, PhaseRun]]],
            server: str) -> dict[str, list[float]]:
    """Each figure's values over the rounds, for `server`."""
    values: dict[str, list[float]] = {}
    for one in rounds:
        for run in one.get(server, {}).values():
            for name, value in run.figures.items():
                values.setdefault(name, []).append(value)
    return values


#: Above this share of the CPU taken by other processes while measuring, the page says
#: the machine was shared.
OTHER_SHARE_MAX = 0.10


def main(args: argparse.Namespace) -> int:
    """Each comparison `--peers` names, its page section written unless `--no-write`."""
    code = llama_main(args) if "llama-server" in args.peers else 0
    if "litellm" in args.peers:
        if args.quick:
            args.litellm_rates, args.litellm_duration, args.litellm_rounds = [10.0, 100.0], 3, 1
        section = litellm_peer.main(args, lambda s: print(s, file=sys.stderr))
        print(section)
        if not args.no_write:
            write_section(args.write, section, LITELLM_SECTION)
            print(f"wrote the {LITELLM_SECTION!r} section of {args.write}", file=sys.stderr)
    return code


def _say(text: str) -> None:
    print(text, file=sys.stderr)


def llama_main(args: argparse.Namespace) -> int:
    """tokenyard beside llama-server (alternating rounds), the section written."""
    quant = model_quant(args.model)
    plan = QUICK if args.quick else PLAN_1_7B if quant else Plan()
    rounds_wanted = plan.rounds if args.quick or args.rounds is None else args.rounds
    build_started = time.monotonic()
    binary = ensure_llama_server(default_cache_dir(), args.build_jobs, say=_say)
    model = (ensure_bench_model(default_cache_dir(), quant, say=_say) if quant
             else embedded_model_path() if args.model == "embedded" else Path(args.model))
    if not model.is_file():
        raise SystemExit(f"--model: no such file {model} (or one of {', '.join(MODEL_CHOICES)})")
    build_s = time.monotonic() - build_started
    _say("measuring the memory bandwidth")
    bandwidth = roofline.measure_bandwidth(args.threads)
    roof = roofline.model_roofline(model, bandwidth, plan.short_input + plan.output // 2)
    started, load_before, others = time.monotonic(), os.getloadavg()[0], OtherLoad()
    rounds: list[dict[str, dict[str, PhaseRun]]] = []
    for r in range(rounds_wanted):
        if (len(rounds) >= min(MIN_ROUNDS, rounds_wanted)
                and time.monotonic() - started > args.budget_min * 60):
            print(f"budget spent: {len(rounds)} rounds", file=sys.stderr)
            break
        order = SERVERS if r % 2 == 0 else SERVERS[::-1]
        one: dict[str, dict[str, PhaseRun]] = {}
        for name in order:
            print(f"round {r + 1}: {name}", file=sys.stderr)
            one[name] = run_server(name, binary, model, plan, 1000 * (r + 1), args.threads)
        rounds.append(one)
    measured_s = time.monotonic() - started
    other_share = others.share(measured_s)
    command = "tokenyard bench peers " + " ".join(sys.argv[3:] if sys.argv[1:2] == ["bench"]
                                                  else sys.argv[1:])
    setup = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores; 1-minute load average "
                   f"{load_before:.2f} before (after: {os.getloadavg()[0]:.2f}, the servers' "
                   "own threads included); other processes took "
                   + ("an unknown share" if other_share is None else f"{other_share:.1%}")
                   + " of the CPU while it measured",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": command.strip(), "model": describe(model, quant) if quant else model.name,
        "llama": f"llama-server from llama_cpp_python {LLAMA_CPP_PYTHON}'s vendored "
                 f"llama.cpp, `-t {args.threads} -np N -c C --cont-batching` (C: 2,048 "
                 "at N = 1, else 512·N)",
        "oversubscribed": (load_before > (os.cpu_count() or 1)
                           or (other_share is not None and other_share > OTHER_SHARE_MAX)),
        "tokenyard": "`tokenyard serve --no-auth "
                     + " ".join(tokenyard_flags(model, args.threads)).replace(str(model), "MODEL")
                     + "` (llama-server's KV cache: float16, the bytes of its 32-slot context)",
        "plan": plan, "rounds": len(rounds), "min_rounds": MIN_ROUNDS,
        "measured_s": measured_s, "build_s": build_s,
    }
    values = {s: medians(rounds, s) for s in SERVERS}
    setup["roofline"] = roofline.roofline_table(
        roof, {s: values[s].get("decode_tok_s", []) for s in SERVERS})
    heading = PAGE_SECTION_1_7B if quant else PAGE_SECTION
    section = render_section(values, [{s: one.get(s, {}) for s in SERVERS} for one in rounds],
                             setup, heading)
    print(section)
    if args.json:
        args.json.write_text(json.dumps(
            [{s: {p: vars(run) for p, run in one[s].items()} for s in one} for one in rounds],
            indent=2))
    if not args.no_write:
        write_section(args.write, section, heading)
        print(f"wrote the {heading!r} section of {args.write}", file=sys.stderr)
    ok = all(run.sent > run.failed for one in rounds for s in one.values()
             for run in s.values())
    return 0 if ok else 1

