"""`tokenyard bench profile`: where one pure decode step's time goes, at batch 1 and 32
(with `--gateway`: where the HTTP gateway's CPU goes under load, `gateway_profile.py`).

The engine runs `batch` streams (45-token prompts, greedy, ignore_eos) until every one is
decoding, then times whole engine steps (scheduler + runner + output bookkeeping) with
the one-op decode step (models/decode_step.py) and with the eager layers, in alternating
rounds. Each step is split into the runner's phases by clocks around them (input
preparation, the layers, the LM head, sampling; the rest is the scheduler and output
bookkeeping). torch.profiler then counts the torch ops a step dispatches: only counts,
since its timings of ops that run `at::parallel_for` are inflated many times over on
this CPU. Then one stream's decode rate through the front end (as `tokenyard bench
offline` measures it) both ways, alternating, and the sampler alone per setting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from tokenyard.bench import gateway_profile
from tokenyard.bench.offline import decode_rate, greedy, random_prompts
from tokenyard.engine.llm import LLM
from tokenyard.engine.sample import Sampler, SamplingBatch
from tokenyard.engine_args import engine_kwargs
from tokenyard.wire.sampling_params import SamplingParams

#: The two ways a pure decode step can run: the one-op step and the eager layers.
PATHS = ("one op", "eager")
PHASES = ("prepare inputs", "layers", "LM head", "sampling", "rest (scheduler, outputs)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default="1,32", help="decode batch sizes to profile")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per path and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--profiled-steps", type=int, default=5, help="steps whose ops are counted")
    parser.add_argument("--output-len", type=int, default=128,
                        help="tokens of the one-stream decode rate")
    gateway_profile.add_arguments(parser)


class Paths:
    """Switches the runner between the one-op decode step and the eager layers, with a
    clock around each phase of `ModelRunner.execute` (instance attributes shadowing the
    runner's and the model's methods; `close` removes them)."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.core.runner
        self.step = self.runner.decode_step
        self.spent: dict[str, float] = defaultdict(float)
        runner, model = self.runner, self.runner.model
        runner.prepare = self._clock("prepare inputs", runner.prepare)
        model.forward = self._clock("layers", model.forward)
        model.compute_logits = self._clock("LM head", model.compute_logits)
        self.sampler = runner.sampler
        runner.sampler = self._clock("sampling", runner.sampler)
        self.timed_step = self._clock("layers", self.step) if self.step is not None else None

    def _clock(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[phase] += time.perf_counter() - start
        return timed

    @property
    def names(self) -> tuple[str, ...]:
        return PATHS if self.step is not None else PATHS[1:]

    def use(self, name: str) -> None:
        self.runner.decode_step = self.timed_step if name == PATHS[0] else None

    def close(self) -> None:
        for owner, attr in ((self.runner, "prepare"), (self.runner.model, "forward"),
                            (self.runner.model, "compute_logits")):
            vars(owner).pop(attr, None)
        self.runner.sampler = self.sampler
        self.runner.decode_step = self.step


def decoding_engine(llm: LLM, batch: int, max_tokens: int, prompt_len: int = 45) -> list[str]:
    """Queue `batch` greedy requests of `max_tokens` out (ignore_eos) and step until each
    has its first token. `max_tokens` covers the steps to be timed, no more: the engine
    admits a request only where the KV pool can hold its whole length (a 1.7B model's
    pool holds a few thousand tokens)."""
    vocab = llm.frontend.model_config.vocab_size
    ids = []
    for i, prompt in enumerate(random_prompts(batch, prompt_len, prompt_len, vocab, seed=7)):
        request_id = f"profile-{batch}-{i}"
        llm.frontend.add_request(request_id, prompt, greedy(max_tokens))
        ids.append(request_id)
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in llm.frontend.step())
    return ids


def profile_batch(
    llm: LLM, paths: Paths, batch: int, args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """Per path: median step ms, mean ms of each phase, and torch ops a step."""
    core = llm.core
    # Each path's warm-up step and timed steps per round, then its profiled steps.
    planned = len(paths.names) * (args.rounds * (args.steps + 1) + args.profiled_steps)
    ids = decoding_engine(llm, batch, planned + 8)
    steps: dict[str, list[float]] = {name: [] for name in paths.names}
    phases: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in paths.names}
    for _ in range(args.rounds):
        for name in paths.names:
            paths.use(name)
            core.step()
            for _ in range(args.steps):
                paths.spent.clear()
                start = time.perf_counter()
                core.step()
                steps[name].append(time.perf_counter() - start)
                for phase in PHASES[:-1]:
                    phases[name][phase].append(paths.spent[phase])
    results: dict[str, dict[str, float]] = {}
    for name in paths.names:
        paths.use(name)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profiled_steps):
                core.step()
        calls = sum(e.count for e in prof.key_averages()) / args.profiled_steps
        row = {phase: statistics.median(phases[name][phase]) * 1000 for phase in PHASES[:-1]}
        step = statistics.median(steps[name]) * 1000
        row[PHASES[-1]] = step - sum(row.values())
        row["step"] = step
        row["ops"] = calls
        results[name] = row
    core.abort(ids)
    while core.has_work:
        core.step()
    return results


def one_stream(llm: LLM, paths: Paths, args: argparse.Namespace) -> dict[str, float]:
    """Median decode tok/s of one stream per path, alternating rounds."""
    vocab = llm.frontend.model_config.vocab_size
    prompt = random_prompts(1, 45, 45, vocab, seed=1)[0]
    rates: dict[str, list[float]] = {name: [] for name in paths.names}
    for _ in range(args.rounds):
        for name in paths.names:
            paths.use(name)
            rates[name].append(decode_rate(llm, prompt, args.output_len))
    return {name: statistics.median(r) for name, r in rates.items()}


#: Sampling setups timed on their own: what each costs a step beside a full-vocabulary sort.
SAMPLERS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.8, top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "temperature 0.8, top-k 50": SamplingParams(temperature=0.8, top_k=50),
    "greedy, repetition penalty 1.1": SamplingParams(temperature=0.0, repetition_penalty=1.1),
}


def sampler_ms(batch: int, vocab: int, params: SamplingParams | None, repeats: int = 30) -> float:
    """Median ms of one sampler call on [batch, vocab] logits (None: one full sort)."""
    gen = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, vocab, generator=gen) * 4
    history = [list(range(100, 400))] * batch  # 300 prompt + output tokens for penalties
    sampler = Sampler()
    sampling = None if params is None else SamplingBatch.from_params(
        [params] * batch, None, history, history)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if sampling is None:
            logits.sort(dim=-1, descending=True)
        else:
            sampler(logits, sampling)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def sampler_table(batches: list[int], vocab: int) -> list[str]:
    lines = ["| sampling | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---" * (len(batches) + 1) + "|"]
    for label, params in [*SAMPLERS.items(), ("(a full sort of the vocabulary)", None)]:
        lines.append(f"| {label} | "
                     + " | ".join(f"{sampler_ms(b, vocab, params):.2f} ms" for b in batches)
                     + " |")
    return lines


def main(args: argparse.Namespace) -> int:
    if args.gateway:
        return gateway_profile.main(args)
    kwargs: dict[str, Any] = engine_kwargs(args)
    llm = LLM(show_progress=False, **kwargs)
    paths = Paths(llm)
    names = paths.names
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, weights "
          f"{llm.frontend.weights}; {args.rounds} alternating rounds of {args.steps} steps "
          f"per path; 1-minute load average {os.getloadavg()[0]:.2f} at the start")
    print("\nMedians over the timed steps, ms a step (on a busy machine, medians resist the "
          "steps another process stalled); the rest is the step's median less the phases'; "
          "torch ops are counted over separate steps.")
    header = "| batch | phase | " + " | ".join(names) + " |"
    print("\n" + header + "\n" + "|---" * (len(names) + 2) + "|")
    batches = [int(b) for b in args.batches.split(",")]
    vocab = llm.frontend.model_config.vocab_size
    for batch in batches:
        result = profile_batch(llm, paths, batch, args)
        for phase in PHASES:
            print(f"| {batch} | {phase} | "
                  + " | ".join(f"{result[n][phase]:.2f}" for n in names) + " |")
        print(f"| {batch} | **step (median)** | "
              + " | ".join(f"**{result[n]['step']:.2f}**" for n in names) + " |")
        print(f"| {batch} | torch ops a step | "
              + " | ".join(f"{result[n]['ops']:.0f}" for n in names) + " |")
    rates = one_stream(llm, paths, args)
    print(f"\nOne stream, decode tok/s ({args.output_len} tokens through the front end, "
          f"medians of {args.rounds} alternating rounds): "
          + ", ".join(f"{n} {rates[n]:.1f}" for n in names)
          + (f" ({rates[PATHS[0]] / rates[PATHS[1]]:.2f}x)" if len(names) == 2 else ""))
    print(f"\nThe sampler alone on random logits ({vocab:,} ids), medians of 30 calls:\n")
    print("\n".join(sampler_table(batches, vocab)))
    print(f"\n1-minute load average at the end: {os.getloadavg()[0]:.2f}")
    paths.close()
    return 0
