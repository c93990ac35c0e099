"""`tokenyard bench profile`: where one pure decode step's time goes, at batch 1 and 32.

The engine runs `batch` streams (45-token prompts, greedy, ignore_eos) until every one is
decoding, then times whole engine steps (scheduler + runner + output bookkeeping) and
runs a few more under torch.profiler. The table splits a step's wall time into the
torch ops it dispatched (self CPU time per step, grouped by op) and what no op accounts
for: Python between the ops, and kernels called outside the dispatcher.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from tokenyard.bench.offline import decode_rate, greedy, random_prompts
from tokenyard.config import engine_kwargs
from tokenyard.engine.llm import LLM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default="1,32", help="decode batch sizes to profile")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per path and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--profiled-steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=10, help="ops listed per table")
    parser.add_argument("--output-len", type=int, default=128,
                        help="tokens of the one-stream decode rate")


#: The two ways a pure decode step can run: the one-op step and the eager layers.
PATHS = ("one op", "eager")


@dataclass(frozen=True)
class OpTime:
    name: str
    calls: float  # per step
    self_us: float  # per step


@dataclass(frozen=True)
class StepProfile:
    path: str
    batch: int
    step_ms: float  # median wall time of one engine step
    ops: list[OpTime]  # every op, most self time first

    @property
    def op_ms(self) -> float:
        return sum(op.self_us for op in self.ops) / 1000

    @property
    def calls(self) -> float:
        return sum(op.calls for op in self.ops)


def decoding_engine(llm: LLM, batch: int, prompt_len: int = 45) -> list[str]:
    """Queue `batch` long greedy requests and step until each has its first token."""
    vocab = llm.frontend.model_config.vocab_size
    ids = []
    for i, prompt in enumerate(random_prompts(batch, prompt_len, prompt_len, vocab, seed=7)):
        request_id = f"profile-{batch}-{i}"
        llm.frontend.add_request(request_id, prompt, greedy(100_000))
        ids.append(request_id)
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in llm.frontend.step())
    return ids


class Paths:
    """Switches the runner between the one-op decode step and the eager layers."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.core.runner
        self.step = self.runner.decode_step

    @property
    def names(self) -> tuple[str, ...]:
        return PATHS if self.step is not None else PATHS[1:]

    def use(self, name: str) -> None:
        self.runner.decode_step = self.step if name == PATHS[0] else None


def profile_batch(
    llm: LLM, paths: Paths, batch: int, args: argparse.Namespace
) -> list[StepProfile]:
    """One StepProfile per path: step times from alternating rounds, ops from a profile."""
    core = llm.core
    ids = decoding_engine(llm, batch)
    times: dict[str, list[float]] = {name: [] for name in paths.names}
    for _ in range(args.rounds):
        for name in paths.names:
            paths.use(name)
            core.step()
            for _ in range(args.steps):
                start = time.perf_counter()
                core.step()
                times[name].append(time.perf_counter() - start)
    results = []
    for name in paths.names:
        paths.use(name)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profiled_steps):
                core.step()
        ops = [OpTime(e.key, e.count / args.profiled_steps,
                      e.self_cpu_time_total / args.profiled_steps)
               for e in prof.key_averages()]
        ops.sort(key=lambda op: -op.self_us)
        results.append(StepProfile(name, batch, statistics.median(times[name]) * 1000, ops))
    paths.use(PATHS[0])
    core.abort(ids)
    while core.has_work:
        core.step()
    return results


def render(result: StepProfile, top: int) -> list[str]:
    other = result.step_ms - result.op_ms
    lines = [
        f"### Decode step, batch {result.batch}, {result.path}: {result.step_ms:.2f} ms a "
        f"step ({result.batch / result.step_ms * 1000:.0f} tok/s)",
        "",
        f"{result.calls:.0f} torch ops a step, {result.op_ms:.2f} ms of their self time; "
        f"{other:.2f} ms outside any op (Python, kernels called without the dispatcher).",
        "",
        "| op | calls a step | self ms a step | share of the step |",
        "|---|---|---|---|",
    ]
    for op in result.ops[:top]:
        lines.append(f"| {op.name} | {op.calls:.0f} | {op.self_us / 1000:.3f} | "
                     f"{op.self_us / 10 / result.step_ms:.1f} % |")
    lines.append(f"| (outside ops) | | {other:.3f} | {other * 100 / result.step_ms:.1f} % |")
    return lines


def one_stream(llm: LLM, paths: Paths, args: argparse.Namespace) -> dict[str, float]:
    """Median decode tok/s of one stream per path, alternating rounds."""
    vocab = llm.frontend.model_config.vocab_size
    prompt = random_prompts(1, 45, 45, vocab, seed=1)[0]
    rates: dict[str, list[float]] = {name: [] for name in paths.names}
    for _ in range(args.rounds):
        for name in paths.names:
            paths.use(name)
            rates[name].append(decode_rate(llm, prompt, args.output_len))
    paths.use(PATHS[0])
    return {name: statistics.median(r) for name, r in rates.items()}


def main(args: argparse.Namespace) -> int:
    kwargs: dict[str, Any] = engine_kwargs(args)
    llm = LLM(show_progress=False, **kwargs)
    paths = Paths(llm)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, weights "
          f"{llm.frontend.weights}, paths: {', '.join(paths.names)}; medians of "
          f"{args.rounds} alternating rounds of {args.steps} steps, ops from "
          f"{args.profiled_steps} profiled steps; 1-minute load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    summary = []
    for batch in (int(b) for b in args.batches.split(",")):
        results = profile_batch(llm, paths, batch, args)
        for result in results:
            print()
            print("\n".join(render(result, args.top)))
        summary.append((f"decode step, batch {batch}",
                        {r.path: f"{r.step_ms:.2f} ms" for r in results}))
    rates = one_stream(llm, paths, args)
    summary.append((f"one stream, decode tok/s ({args.output_len} tokens, through the front end)",
                    {name: f"{rate:.1f}" for name, rate in rates.items()}))
    print("\n### Side by side (same process, alternating rounds)\n")
    print("| figure | " + " | ".join(paths.names) + " |")
    print("|---" * (len(paths.names) + 1) + "|")
    for label, cells in summary:
        print(f"| {label} | " + " | ".join(cells[name] for name in paths.names) + " |")
    print(f"\n1-minute load average at the end: {os.getloadavg()[0]:.2f}")
    return 0
