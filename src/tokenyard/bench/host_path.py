"""`tokenyard bench host`: the host path alone, with a model that costs nothing.

The replica's model is `engine/null_model.py` (``TOKENYARD_NULL_MODEL=on``): the real
scheduler, KV manager, runner input preparation, sampler and output processing, the
replica server, balancer and gateway, around a forward pass that computes nothing. So
what a step or a token costs here is the host's work, the part that bounds an accelerator
from above (issue 37).

1. The engine alone (`LLM`, in this process): `n` requests at once (1, 32, 256 by
   default), `--input-len` random prompt tokens, `--output-len` tokens out, greedy. Host
   µs per step and per running sequence per step are medians over the pure decode steps
   (those where every running sequence got a token); tok/s is the whole run's output over
   its wall time.
2. Served: one ``tokenyard serve`` of the null model (auth on, one replica, the engine's
   `--max-num-seqs` the largest level; one torch thread in both, `THREADS`), `n`
   streamed chat requests at concurrency `n`, `--output-len` tokens out (``ignore_eos``,
   greedy); output tok/s, and CPU µs per output token of each process (gateway,
   replica, the load generator).
3. Rounds alternate the two (engine first in even rounds, served first in odd ones);
   tables give medians with min and max, and the other processes' share of the machine's
   CPU meanwhile (their load skews a 2-core machine's figures).
4. Where the time goes (`bench/host_profile.py`): cProfile over the engine alone's steps
   and over the gateway process's event loop under the largest level, by stage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenyard.bench.children import Child, start_tokenyard
from tokenyard.bench.host import cpu_model
from tokenyard.bench.loadgen import Target, list_models, run_load
from tokenyard.bench.proctree import machine_busy_s, sample_proc, tree_pids
from tokenyard.bench.stats import summarize
from tokenyard.bench.workloads import LengthDist, synthetic

LEVELS = (1, 32, 256)
ROUNDS = 3
INPUT_LEN = 64
OUTPUT_LEN = 128
#: The null model's KV pool: one layer of the embedded model's shape, room for 256
#: sequences of a few hundred tokens.
KV_CACHE_GIB = 0.25
#: torch threads of both engines: the null model leaves nothing to split over cores, and
#: on a shared 2-core machine a parallel region's barrier waits a scheduler tick for a
#: descheduled worker (steps of 16 ms among ones of 0.8 ms were measured with 2).
THREADS = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--levels", type=lambda v: [int(x) for x in v.split(",")],
                        default=list(LEVELS), help="sequences / streams at once (1,32,256)")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="alternating rounds of the engine alone and served")
    parser.add_argument("--input-len", type=int, default=INPUT_LEN,
                        help="prompt tokens (served: words, about tokens)")
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN, help="tokens out")
    parser.add_argument("--no-profile", action="store_true", help="skip the stage profile")
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")


@dataclass
class EngineRun:
    """One engine-alone run of `n` sequences."""

    n: int
    step_us: float  # median wall time of a pure decode step
    step_cpu_us: float  # median process CPU time of one (all threads)
    decode_steps: int
    tokens: int
    wall_s: float

    @property
    def per_seq_us(self) -> float:
        return self.step_us / self.n

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


@dataclass
class ServedRun:
    """One served run at `n` streams."""

    n: int
    tok_s: float
    tokens: int
    failed: int
    ttft_p50_ms: float
    #: CPU µs per output token, by process: gateway, replica, client.
    cpu_us_per_token: dict[str, float] = field(default_factory=dict)
    stages_ms: dict[str, float] = field(default_factory=dict)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def null_llm(max_num_seqs: int) -> Any:
    """An offline engine of the null model (torch is imported here, not at module load)."""
    from tokenyard.engine.llm import LLM

    return LLM(null_model=True, max_num_seqs=max_num_seqs, kv_cache_gib=KV_CACHE_GIB,
               num_threads=THREADS)


def engine_run(llm: Any, n: int, input_len: int, output_len: int, seed: int) -> EngineRun:
    """`n` requests at once through `llm.frontend`, each step timed."""
    from tokenyard.engine.null_model import FIRST_TEXT_ID, NULL_VOCAB
    from tokenyard.wire.sampling_params import SamplingParams

    frontend = llm.frontend
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    for i in range(n):
        ids = [rng.randrange(FIRST_TEXT_ID, NULL_VOCAB) for _ in range(input_len)]
        frontend.add_request(f"host-{seed}-{i}", ids, params)
    walls: list[float] = []
    cpus: list[float] = []
    tokens = 0
    started: set[str] = set()  # requests past their prefill
    start = time.perf_counter()
    while frontend.has_work:
        w, c = time.perf_counter(), time.process_time()
        outputs = frontend.step()
        wall, cpu = time.perf_counter() - w, time.process_time() - c
        got = sum(len(d.token_ids) for o in outputs for d in o.deltas)
        tokens += got
        # A pure decode step: every sequence was past its prefill before it, got a
        # token from it and goes on after it.
        if (got == n and len(started) == n
                and not any(o.finished for o in outputs)):
            walls.append(wall)
            cpus.append(cpu)
        started.update(o.request_id for o in outputs)
    elapsed = time.perf_counter() - start
    return EngineRun(n, 1e6 * _median(walls or [elapsed]), 1e6 * _median(cpus or [0.0]),
                     len(walls), tokens, elapsed)


def start_server(max_num_seqs: int, python: Sequence[str] = ()) -> tuple[Child, str | None]:
    """``tokenyard serve`` of the null model with auth on; its API key."""
    return start_tokenyard(
        None, auth=True, python=python,
        env_extra={"TOKENYARD_NULL_MODEL": "on"},
        extra=["--max-num-seqs", str(max_num_seqs), "--kv-cache-gib", str(KV_CACHE_GIB),
               "--threads", str(THREADS)])


def _process_cpu(child: Child) -> dict[str, float]:
    """CPU seconds so far of the server's processes: the root (the gateway: one HTTP
    worker) and its descendants (the replica)."""
    out = {"gateway": 0.0, "replica": 0.0}
    for pid in tree_pids(child.pid):
        try:
            cpu = sample_proc(pid).cpu_s
        except (OSError, ValueError, IndexError):
            continue
        out["gateway" if pid == child.pid else "replica"] += cpu
    return out


async def served_run(child: Child, key: str | None, n: int, input_len: int,
                     output_len: int, seed: int) -> ServedRun:
    """`n` streamed chat requests at concurrency `n` against `child`."""
    base = child.url + "/v1"
    model = (await list_models(base, key))[0]
    target = Target(base, model, api_key=key, stream=True, ignore_eos=True, temperature=0.0)
    workload = synthetic(LengthDist(input_len), LengthDist(output_len), seed)
    before = _process_cpu(child)
    load = await run_load(target, workload, concurrency=n, max_requests=n, seed=seed)
    after = _process_cpu(child)
    report = summarize(load.records, load.duration_s, None, None)
    tokens = max(1, report.output_tokens)
    cpu = {k: 1e6 * (after[k] - before[k]) / tokens for k in before}
    cpu["client"] = 1e6 * load.client_cpu_s / tokens
    return ServedRun(n, report.output_token_rate, report.output_tokens, report.failed,
                     report.ttft_ms.p50 if report.ttft_ms else 0.0, cpu,
                     dict(report.server_timing_ms))


@dataclass
class Results:
    """Every round's runs, and the other processes' CPU share per round."""

    engine: dict[int, list[EngineRun]] = field(default_factory=dict)
    served: dict[int, list[ServedRun]] = field(default_factory=dict)
    other_load: list[float] = field(default_factory=list)
    profile: list[str] = field(default_factory=list)


def measure(args: argparse.Namespace, say: Callable[[str], None] = print) -> Results:
    """The alternating rounds (see the module)."""
    largest = max(args.levels)
    llm = null_llm(largest)
    child, key = start_server(largest)
    results = Results()
    try:
        # Warm both (first compiles, first connections) before any figure counts.
        engine_run(llm, 2, 8, 4, seed=-1)
        asyncio.run(served_run(child, key, 2, 8, 4, seed=99_999))
        for r in range(args.rounds):
            busy0, own0 = machine_busy_s(), _own_cpu_s()
            server0 = sum(_process_cpu(child).values())
            t0 = time.perf_counter()
            for n in args.levels:
                seed = 1000 * r + n
                order = ("engine", "served") if r % 2 == 0 else ("served", "engine")
                for which in order:
                    if which == "engine":
                        run = engine_run(llm, n, args.input_len, args.output_len, seed)
                        results.engine.setdefault(n, []).append(run)
                    else:
                        served = asyncio.run(served_run(child, key, n, args.input_len,
                                                        args.output_len, seed))
                        results.served.setdefault(n, []).append(served)
            wall = time.perf_counter() - t0
            ours = (_own_cpu_s() - own0) + (sum(_process_cpu(child).values()) - server0)
            other = max(0.0, machine_busy_s() - busy0 - ours) / (wall * (os.cpu_count() or 1))
            results.other_load.append(other)
            say(f"round {r + 1}/{args.rounds}: {wall:.1f} s, other processes "
                f"{other:.0%} of the CPU")
    finally:
        child.stop()
        llm.frontend.core.close()
    if not args.no_profile:
        from tokenyard.bench.host_profile import profile_stages

        results.profile = profile_stages(largest, args.input_len, args.output_len,
                                         sys.modules[__name__])
    return results


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _spread(values: Sequence[float], fmt: str = "{:.0f}") -> str:
    """median (min-max)."""
    return (f"{fmt.format(_median(values))} ({fmt.format(min(values))}-"
            f"{fmt.format(max(values))})")


def render(results: Results, args: argparse.Namespace) -> str:
    """The markdown tables of `results`."""
    rounds = len(results.other_load)
    lines = [
        f"Null model (engine/null_model.py), {args.input_len}-token prompts, "
        f"{args.output_len} tokens out, greedy, ignore_eos; medians of {rounds} "
        "alternating rounds (min-max in brackets). Machine: "
        f"{cpu_model()}, {os.cpu_count()} cores; other processes used "
        f"{_spread([100 * v for v in results.other_load])} % of the CPU per round.",
        "",
        "| sequences | engine host µs / step | µs / sequence / step | goal | "
        "engine tok/s | served tok/s (stream, auth) | served / engine | goal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in sorted(results.engine):
        eng, srv = results.engine[n], results.served.get(n, [])
        ratios = [s.tok_s / e.tok_s for e, s in zip(eng, srv, strict=False) if e.tok_s]
        step_goal = "<= 1000 µs / step" if n == 1 else "<= 30 µs / seq" if n >= 256 else ""
        ratio_goal = ">= 95 %" if n == 1 else ">= 80 %" if n >= 256 else ""
        lines.append(
            f"| {n} | {_spread([e.step_us for e in eng])} | "
            f"{_spread([e.per_seq_us for e in eng], '{:.1f}')} | {step_goal} | "
            f"{_spread([e.tok_s for e in eng])} | "
            f"{_spread([s.tok_s for s in srv]) if srv else '-'} | "
            f"{_spread([100 * r for r in ratios]) + ' %' if ratios else '-'} | {ratio_goal} |")
    lines += ["", "| streams | CPU µs / token: gateway | replica | load generator | "
              "TTFT p50 ms | failed | Server-Timing means (ms) |", "|---|---|---|---|---|---|---|"]
    for n in sorted(results.served):
        srv = results.served[n]
        stages = {k: _median([s.stages_ms.get(k, 0.0) for s in srv])
                  for k in srv[-1].stages_ms}
        shown = ", ".join(f"{k} {v:.1f}" for k, v in stages.items())
        lines.append(
            f"| {n} | {_spread([s.cpu_us_per_token['gateway'] for s in srv])} | "
            f"{_spread([s.cpu_us_per_token['replica'] for s in srv])} | "
            f"{_spread([s.cpu_us_per_token['client'] for s in srv])} | "
            f"{_spread([s.ttft_p50_ms for s in srv])} | {sum(s.failed for s in srv)} | "
            f"{shown} |")
    if results.profile:
        lines += ["", *results.profile]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1 or min(args.levels) < 1:
        raise SystemExit("--rounds and every level must be >= 1")
    # Progress on stderr: stdout is the section `bench suite` writes into the docs.
    results = measure(args, say=lambda m: print(m, file=sys.stderr, flush=True))
    print(render(results, args))
    if args.json:
        args.json.write_text(json.dumps({
            "engine": {n: [asdict(r) for r in runs] for n, runs in results.engine.items()},
            "served": {n: [asdict(r) for r in runs] for n, runs in results.served.items()},
            "other_load": results.other_load}, indent=2))
    failed = sum(s.failed for runs in results.served.values() for s in runs)
    return 1 if failed else 0
