"""`tokenyard bench serve`: load-test any OpenAI- or Anthropic-compatible server.

Open loop (`--rate`, Poisson arrivals) or closed loop (`--concurrency`, a list such as
``1,2,4`` runs each level in turn), bounded by `--requests` and/or `--duration`. Prints a
table, and writes the full report as JSON (`--out`) and plots (`--plot-dir`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tokenyard.bench.loadgen import APIS, LoadResult, Target, list_models, run_load
from tokenyard.bench.stats import Distribution, Report, summarize
from tokenyard.bench.workloads import (
    LEN_DISTS,
    WORKLOADS,
    LengthDist,
    default_lengths,
    make_workload,
)

DEFAULT_REQUESTS = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tokenyard bench serve`."""
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="the server's base URL, ending in /v1")
    target.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    target.add_argument("--api-key", help="sent as a bearer token")
    target.add_argument("--api", choices=APIS, default="openai-chat")
    target.add_argument("--no-stream", action="store_true",
                        help="ask for whole answers (TTFT is then the whole latency)")
    target.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    load = parser.add_argument_group("load")
    load.add_argument("--rate", type=float_list,
                      help="open loop: Poisson arrivals, requests/s; a list (1,5,10) runs "
                           "each level")
    load.add_argument("--concurrency", type=_int_list,
                      help="closed loop: requests in flight; a list (1,2,4) runs each level")
    load.add_argument("--requests", type=int,
                      help=f"requests per level (default {DEFAULT_REQUESTS} without --duration)")
    load.add_argument("--duration", type=float, help="seconds per level")
    load.add_argument("--seed", type=int, default=0,
                      help="seeds arrivals and prompts (the i-th level adds 1000·i)")
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    work.add_argument("--input-len", type=int,
                      help="prompt words, about tokens (default: synthetic 256, multiturn "
                           "64 per turn, long 1200)")
    work.add_argument("--output-len", type=int,
                      help="max_tokens (default: synthetic 128, multiturn 64, long 32)")
    work.add_argument("--len-dist", choices=LEN_DISTS, default="fixed")
    work.add_argument("--len-spread", type=float, default=0.25,
                      help="uniform: ± this fraction of the length; normal: its sd / mean")
    work.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    work.add_argument("--conversations", type=int, default=4,
                      help="multiturn: conversations open at once")
    work.add_argument("--ignore-eos", action="store_true",
                      help="send ignore_eos: true (vLLM's extension)")
    work.add_argument("--temperature", type=float,
                      help="send this temperature (default: none, the server's own; 0 is "
                           "greedy, as the offline engine's figures are)")
    out = parser.add_argument_group("report")
    out.add_argument("--slo-ttft", type=float, help="goodput SLO: TTFT in ms")
    out.add_argument("--slo-itl", type=float, help="goodput SLO: mean ITL per request in ms")
    out.add_argument("--out", type=Path, help="write the results as JSON here")
    out.add_argument("--save-requests", action="store_true",
                     help="include every request's record in the JSON")
    out.add_argument("--plot-dir", type=Path, help="write PNG plots here")
    out.add_argument("--quiet", action="store_true", help="no progress bar")


def _positive_list(text: str, kind: type[float] | type[int], what: str) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} like 1,2,4, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{what} must be > 0")
    return values


def _int_list(text: str) -> list[int]:
    return _positive_list(text, int, "concurrency levels")


def float_list(text: str) -> list[float]:
    """argparse type: a comma-separated list of positive numbers ("100,500")."""
    return _positive_list(text, float, "rates")


@dataclass(frozen=True)
class Level:
    """One load level: a rate (open loop) or a concurrency (closed loop)."""

    rate: float | None = None
    concurrency: int | None = None

    @property
    def label(self) -> str:
        return f"rate={self.rate:g}/s" if self.rate is not None else f"c={self.concurrency}"


@dataclass
class LevelResult:
    """A level's load run and its report."""

    level: Level
    load: LoadResult
    report: Report

    def to_json(self, with_requests: bool = False) -> dict[str, Any]:
        """The level, its report and this process's CPU use (and the records if asked)."""
        out: dict[str, Any] = {
            **asdict(self.level), "report": self.report.to_json(),
            "client_cpu_s": self.load.client_cpu_s,
            "client_cpu_pct": cpu_pct(self.load.client_cpu_s, self.load.duration_s),
        }
        if with_requests:
            out["requests"] = [asdict(r) for r in self.load.records]
        return out


def cpu_pct(cpu_s: float, wall_s: float) -> float:
    """CPU time as a percentage of one core over `wall_s`."""
    return 100.0 * cpu_s / wall_s if wall_s > 0 else 0.0


def levels_of(args: argparse.Namespace) -> list[Level]:
    """The load levels the flags ask for (closed loop at concurrency 1 by default)."""
    if args.rate is not None and args.concurrency is not None:
        raise ValueError("give --rate (open loop) or --concurrency (closed loop), not both")
    if args.rate is not None:
        return [Level(rate=rate) for rate in args.rate]
    return [Level(concurrency=c) for c in args.concurrency or [1]]


def lengths_of(args: argparse.Namespace) -> tuple[LengthDist, LengthDist]:
    """(input, output) length distributions from the flags and the workload's defaults."""
    default_in, default_out = default_lengths(args.workload)
    return (
        LengthDist(args.input_len or default_in, args.len_dist, args.len_spread),
        LengthDist(args.output_len or default_out, args.len_dist, args.len_spread),
    )


def level_seed(seed: int, index: int) -> int:
    """The seed of the `index`-th level: each level sends prompts of its own, so a later
    level does not find the earlier levels' prompts in the server's prefix cache."""
    return seed + 1000 * index


async def run_levels(
    target: Target, levels: Sequence[Level], args: argparse.Namespace,
) -> list[LevelResult]:
    """Run each level in turn, each with its own seed (`level_seed`)."""
    input_len, output_len = lengths_of(args)
    max_requests = args.requests
    if max_requests is None and args.duration is None:
        max_requests = DEFAULT_REQUESTS
    progress = not args.quiet and sys.stderr.isatty()
    results = []
    for i, level in enumerate(levels):
        seed = level_seed(args.seed, i)
        workload = make_workload(args.workload, input_len, output_len, seed,
                                 args.turns, args.conversations)
        load = await run_load(
            target, workload, rate=level.rate, concurrency=level.concurrency,
            max_requests=max_requests, duration_s=args.duration, seed=seed,
            progress=progress,
        )
        report = summarize(load.records, load.duration_s, args.slo_ttft, args.slo_itl)
        results.append(LevelResult(level, load, report))
        if not args.quiet:
            print(f"{level.label}: {report.completed}/{report.sent} completed in "
                  f"{report.duration_s:.1f} s", file=sys.stderr)
    return results


def _pair(d: Distribution | None) -> str:
    return "-" if d is None else f"{d.p50:.1f} / {d.p99:.1f}"


def _failed(r: Report) -> str:
    """The failed count, with each kind's count when there are failures."""
    kinds = ", ".join(f"{kind} {n}" for kind, n in r.failures.items())
    return f"{r.failed} ({kinds})" if kinds else str(r.failed)


def render_table(results: Sequence[LevelResult]) -> str:
    """The levels as a markdown table, failures and Server-Timing stages below it."""
    lines = [
        "| level | sent | ok | failed | s | req/s | out tok/s | TTFT p50/p99 ms | "
        "ITL p50/p99 ms | TPOT p50/p99 ms | e2e p50/p99 ms | goodput req/s | client CPU % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        r = res.report
        goodput = "-" if r.goodput is None else f"{r.goodput:.2f}"
        lines.append(
            f"| {res.level.label} | {r.sent} | {r.completed} | {_failed(r)} | "
            f"{r.duration_s:.1f} | {r.request_rate:.2f} | {r.output_token_rate:.1f} | "
            f"{_pair(r.ttft_ms)} | {_pair(r.itl_ms)} | {_pair(r.tpot_ms)} | "
            f"{_pair(r.e2e_ms)} | {goodput} | "
            f"{cpu_pct(res.load.client_cpu_s, res.load.duration_s):.0f} |"
        )
    notes = []
    for res in results:
        r = res.report
        if r.failures:
            kinds = ", ".join(f"{k}: {n} ({r.failure_examples.get(k, '')})"
                              for k, n in r.failures.items())
            notes.append(f"failed at {res.level.label}: {kinds}")
        if res.load.retried:
            notes.append(f"sent again on a fresh connection at {res.level.label}: "
                         f"{res.load.retried} (the server had closed the pooled one)")
        if r.server_timing_ms:
            stages = ", ".join(f"{k} {v:.2f}" for k, v in r.server_timing_ms.items())
            notes.append(f"Server-Timing means at {res.level.label} (ms): {stages}")
    return "\n".join([*lines, "", *notes] if notes else lines)


async def resolve_model(args: argparse.Namespace) -> str:
    """`--model`, or the first model the server lists."""
    if args.model:
        return str(args.model)
    models = await list_models(args.base_url, args.api_key)
    if not models:
        raise ValueError(f"{args.base_url}/models lists no model; pass --model")
    return models[0]


def main(args: argparse.Namespace) -> int:
    """Run the benchmark the flags describe; print, and write JSON and plots if asked.
    Returns 1 if no request completed."""
    levels = levels_of(args)
    if args.requests is not None and args.requests < 1:
        raise ValueError("--requests must be >= 1")
    lengths_of(args)  # refuse bad lengths before any request goes out
    try:
        model = asyncio.run(resolve_model(args))
    except (aiohttp.ClientError, TimeoutError) as exc:
        print(f"error: cannot list the models at {args.base_url}: {exc}", file=sys.stderr)
        return 1
    target = Target(args.base_url, model, args.api, args.api_key, stream=not args.no_stream,
                    ignore_eos=args.ignore_eos, temperature=args.temperature,
                    timeout_s=args.timeout)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results = asyncio.run(run_levels(target, levels, args))
    input_len, output_len = lengths_of(args)
    print(f"tokenyard bench serve: {args.api} {target.url}, model {model}, {args.workload} "
          f"workload, input {input_len.mean} output {output_len.mean} ({args.len_dist}), "
          f"seed {args.seed}")
    print(render_table(results))
    if args.out:
        doc = {
            "config": {
                "base_url": args.base_url, "model": model, "api": args.api,
                "stream": target.stream, "workload": args.workload,
                "input_len": asdict(input_len), "output_len": asdict(output_len),
                "ignore_eos": args.ignore_eos, "seed": args.seed, "requests": args.requests,
                "duration_s": args.duration, "slo_ttft_ms": args.slo_ttft,
                "slo_itl_ms": args.slo_itl, "started": started,
            },
            "levels": [res.to_json(args.save_requests) for res in results],
        }
        args.out.write_text(json.dumps(doc, indent=2))
    if args.plot_dir:
        from tokenyard.bench.plots import write_plots

        paths = write_plots(
            [(res.level.label, res.level.concurrency, res.load.records, res.report)
             for res in results],
            args.plot_dir,
        )
        print("plots: " + ", ".join(str(p) for p in paths))
    # Exit 1 when nothing succeeded: a script sees the server was not served.
    return 0 if any(res.report.completed for res in results) else 1
