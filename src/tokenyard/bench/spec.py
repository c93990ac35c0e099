"""`tokenyard bench spec`: n-gram speculative decoding against none, one stream, the
embedded model, on two workloads: an edit (the reply repeats most of the prompt: drafts
are found) and a free answer (little to look up: speculation must not cost). `--draft
MODEL` measures a draft model's speculation instead (vLLM's `draft_model` method).

The two engines run side by side in one process and alternate, round by round; the figure
is each workload's tokens/s ratio (speculating / not), median with min and max over the
rounds. Greedy, so both engines produce the same tokens (checked every round).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from tokenyard.bench.host import cpu_model
from tokenyard.engine.llm import LLM
from tokenyard.wire.sampling_params import SamplingParams

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'
EDIT_TEXT = (
    "Our team meets every Tuesday at 10 am in the small conference room on the third "
    "floor. Please bring your laptop, the weekly report and any questions you have about "
    "the project. If you can not attend, send a short note to the team lead before the "
    "meeting starts, so that we can plan the work for the rest of the week. The coffee "
    "machine on the third floor is broken, so please use the one in the kitchen on the "
    "second floor until it is repaired. Thank you all for your hard work this month."
)
WORKLOADS: dict[str, list[dict[str, str]]] = {
    "edit": [{"role": "user", "content": "Rewrite the following text, replacing 'Tuesday' "
              f"with 'Wednesday' and changing nothing else:\n\n{EDIT_TEXT}"}],
    "free": [{"role": "user", "content": "Write a short story about a lighthouse keeper "
              "who finds a message in a bottle."}],
}


@dataclass
class Round:
    rates: dict[tuple[str, bool], float] = field(default_factory=dict)


def _rate(llm: LLM, prompt: Any, max_tokens: int) -> tuple[float, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=False)
    start = time.perf_counter()
    tokens = llm.generate([prompt], params)[0].completions[0].token_ids
    return len(tokens) / (time.perf_counter() - start), tokens


def spec_config(draft: str | None) -> str:
    """The speculation measured: n-gram lookup, or the `draft` model's (k=4)."""
    if draft is None:
        return SPEC
    return json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 4})


def measure(rounds: int, max_tokens: int, threads: int | None,
            draft: str | None = None) -> tuple[list[Round], dict[str, float]]:
    engines = {spec: LLM(speculative_config=spec_config(draft) if spec else None,
                         num_threads=threads)
               for spec in (False, True)}
    for llm in engines.values():  # warm: kernels built, prefix cached alike for both
        for prompt in WORKLOADS.values():
            _rate(llm, prompt, 8)
    out: list[Round] = []
    for i in range(rounds):
        one = Round()
        for name, prompt in WORKLOADS.items():
            order = (False, True) if i % 2 == 0 else (True, False)
            tokens: dict[bool, list[int]] = {}
            for spec in order:
                one.rates[name, spec], tokens[spec] = _rate(engines[spec], prompt, max_tokens)
            if tokens[True] != tokens[False]:
                raise AssertionError(f"{name}: greedy output differs with speculation")
        out.append(one)
    speculator = engines[True].core.scheduler.speculator
    accepted = speculator.num_accepted / max(1, speculator.num_drafts) if speculator else 0.0
    return out, {"acceptance": accepted}


def render(rounds: list[Round], extra: dict[str, float], max_tokens: int,
           draft: str | None = None) -> str:
    method = "n-gram" if draft is None else f"draft model {draft}"
    lines = [f"One stream, greedy, up to {max_tokens} tokens, {len(rounds)} alternating "
             f"rounds on {cpu_model()}; {method} k=4. Draft acceptance overall: "
             f"{extra['acceptance']:.0%}.", "",
             "| workload | off tok/s (median) | on tok/s (median) | ratio median | min | max |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in WORKLOADS:
        off = [r.rates[name, False] for r in rounds]
        on = [r.rates[name, True] for r in rounds]
        ratios = [b / a for a, b in zip(off, on, strict=True)]
        lines.append(f"| {name} | {statistics.median(off):.1f} | {statistics.median(on):.1f} "
                     f"| {statistics.median(ratios):.2f}x | {min(ratios):.2f}x "
                     f"| {max(ratios):.2f}x |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens per reply")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--draft", default=None, metavar="MODEL",
                        help="a draft model (GGUF, folder or name sharing the embedded "
                             "model's tokenizer) instead of n-gram lookup")


def main(args: argparse.Namespace) -> int:
    rounds, extra = measure(args.rounds, args.max_tokens, args.threads, args.draft)
    print(render(rounds, extra, args.max_tokens, args.draft))
    return 0
