"""`tokenyard bench lora`: many LoRA adapters at once on one replica against the base model
alone, at the same concurrency (issue 39's goal: aggregate tokens/s with 8 adapters at
least 70 % of the base's, and switching adapters costs no extra step).

One engine serves both (`--lora-modules` with `--max-loras` = the adapters): a round runs
`streams` requests of the base model at once, and `streams` requests spread over the
adapters at once (stream i on adapter i mod N), in alternating order round by round. Each
request generates exactly `max_tokens` (EOS ignored), so both sides compute the same
tokens; the steps each side took are counted too (adapters must take no more). The
adapters are random q/v adapters of rank 8 (`bench/lora_adapters.py`), loaded before the
first round. The figure is the ratio adapters / base per round: median, min and max.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tokenyard.bench.host import cpu_model
from tokenyard.bench.lora_adapters import write_adapters
from tokenyard.engine.llm import LLM
from tokenyard.wire.sampling_params import SamplingParams

PROMPTS = [
    "Write a short note about the weather today.",
    "List three things to pack for a day at the beach.",
    "Explain in two sentences what a compiler does.",
    "Describe a quiet morning in a small village.",
    "Give some advice for a first job interview.",
    "What makes a good cup of tea?",
    "Tell me about the moon in a few lines.",
    "Suggest a name for a friendly robot and say why.",
]


@dataclass
class Side:
    """One side of one round: tokens/s over all its streams and the steps it took."""

    rate: float
    steps: int


def _run(llm: LLM, streams: int, loras: list[str | None], max_tokens: int) -> Side:
    """`streams` requests at once (stream i on `loras[i % len(loras)]`) to the end."""
    frontend = llm.frontend
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        ids = frontend.prompt_token_ids([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        frontend.add_request(f"bench-{time.monotonic_ns()}-{i}", ids, params,
                             lora=loras[i % len(loras)])
    tokens = steps = 0
    start = time.perf_counter()
    while frontend.has_work:
        for out in frontend.step():
            tokens += sum(len(d.token_ids) for d in out.deltas)
        steps += 1
    elapsed = time.perf_counter() - start
    return Side(tokens / elapsed, steps)


def measure(rounds: int, streams: int, adapters: int, max_tokens: int,
            threads: int | None, root: Path) -> list[dict[str, Side]]:
    folders = write_adapters(root, adapters)
    llm = LLM(lora_modules=",".join(f"{n}={p}" for n, p in folders.items()),
              max_loras=adapters, max_lora_rank=8, num_threads=threads,
              max_num_seqs=max(streams, 8))
    names: list[str | None] = list(folders)
    sides: dict[str, list[str | None]] = {"base": [None], "adapters": names}
    for loras in sides.values():  # warm: kernels built, every adapter in its slot
        _run(llm, streams, loras, 4)
    out = []
    for i in range(rounds):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        out.append({name: _run(llm, streams, sides[name], max_tokens) for name in order})
    return out


def render(rounds: list[dict[str, Side]], streams: int, adapters: int,
           max_tokens: int) -> str:
    base = [r["base"].rate for r in rounds]
    tuned = [r["adapters"].rate for r in rounds]
    ratios = [t / b for b, t in zip(base, tuned, strict=True)]
    extra = [r["adapters"].steps - r["base"].steps for r in rounds]
    lines = [f"{streams} streams at once, greedy, {max_tokens} tokens each, {len(rounds)} "
             f"alternating rounds on {cpu_model()}; {adapters} random q/v adapters of "
             "rank 8, all resident.", "",
             "| side | tok/s median | min | max |", "|---|---:|---:|---:|"]
    for name, rates in (("base model alone", base), (f"{adapters} adapters", tuned)):
        lines.append(f"| {name} | {statistics.median(rates):.1f} | {min(rates):.1f} "
                     f"| {max(rates):.1f} |")
    lines += ["", f"Adapters / base: median {statistics.median(ratios):.0%}, min "
              f"{min(ratios):.0%}, max {max(ratios):.0%} (goal: at least 70 %). Extra "
              f"steps the adapters took per round: {extra} (goal: 0)."]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    parser.add_argument("--streams", type=int, default=8, help="requests at once (8)")
    parser.add_argument("--adapters", type=int, default=8, help="adapters served (8)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="tokenyard-lora-") as root:
        rounds = measure(args.rounds, args.streams, args.adapters, args.max_tokens,
                         args.threads, Path(root))
    print(render(rounds, args.streams, args.adapters, args.max_tokens))
    return 0
