"""`tokenyard bench micro`'s prefix-cache hit: the embedded model in-process, a ~1,000-token
chat prompt sent again once it is cached, time to its first token (one output token:
the prefill of the uncached tail with attention over the whole cached context, the LM head
row and greedy sampling).

The tail is run three ways, alternating request by request in one process so a busy
machine hurts them alike: as rows of the one-op decode step (`paged_attention.
ONE_OP_TAIL_ROWS`, the engine's path where the model has that op), through the eager
layers with the paged kernel reading the cached blocks in place (`KERNEL_TAIL_ROWS`), and
through the eager layers gathering the context into one tensor for SDPA (the first path).
Wall and process CPU time are both reported: on a shared machine the wall figure carries
the waits for a core, the CPU figure the work done.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tokenyard.engine import paged_attention
from tokenyard.engine.llm import LLM
from tokenyard.wire.sampling_params import SamplingParams

_WORDS = ["the", "of", "and", "to", "in", "is", "was", "that", "for", "on", "with", "as",
          "by", "at", "from", "this", "be", "have", "are", "not", "river", "stone", "light",
          "house", "morning", "letter", "garden", "window", "road"]


@dataclass
class PrefixHit:
    prompt_tokens: int
    cached_tokens: int
    same_output: bool  # the cached prompt's greedy tokens equal the uncached run's, each path
    #: path -> [(wall ms, cpu ms)] per request
    times: dict[str, list[tuple[float, float]]]


def chat_prompt(llm: LLM, tokens: int = 1000) -> list[dict[str, str]]:
    """A one-message chat of random common words that templates to `tokens` tokens or just
    under: with 16-token blocks a 1,000-token prompt caches 992 and runs 8 (the case of
    issue 26 and of `bench serve`'s 1,000-token prompt)."""
    rng = random.Random(26)
    words = [rng.choice(_WORDS) for _ in range(tokens)]
    while True:
        prompt = [{"role": "user", "content": " ".join(words)}]
        excess = len(llm.frontend.prompt_token_ids(prompt)) - tokens
        if excess <= 0:
            return prompt
        del words[-excess:]


def measure(rounds: int = 7, threads: int = 2, tokens: int = 1000) -> PrefixHit:
    """Cold run of the prompt, then `rounds` alternating rounds of cached runs."""
    llm = LLM(num_threads=threads)
    prompt = chat_prompt(llm, tokens)
    one, eight = (SamplingParams(max_tokens=n, temperature=0.0) for n in (1, 8))
    cold = llm.generate(prompt, eight)[0]
    saved = paged_attention.ONE_OP_TAIL_ROWS, paged_attention.KERNEL_TAIL_ROWS
    # path -> (ONE_OP_TAIL_ROWS, KERNEL_TAIL_ROWS)
    paths = {"one-op step": saved, "eager layers, kernel in place": (0, saved[1]),
             "eager layers, gather + SDPA": (0, 0)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    cached = 0
    same = True
    try:
        for r in range(rounds):
            for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                paged_attention.ONE_OP_TAIL_ROWS, paged_attention.KERNEL_TAIL_ROWS = paths[name]
                wall, cpu = time.perf_counter(), time.process_time()
                cached = llm.generate(prompt, one)[0].num_cached_tokens
                times[name].append(((time.perf_counter() - wall) * 1e3,
                                    (time.process_time() - cpu) * 1e3))
        for setting in paths.values():  # every path's greedy tokens, cached
            paged_attention.ONE_OP_TAIL_ROWS, paged_attention.KERNEL_TAIL_ROWS = setting
            again = llm.generate(prompt, eight)[0]
            same = same and again.completions[0].token_ids == cold.completions[0].token_ids
    finally:
        paged_attention.ONE_OP_TAIL_ROWS, paged_attention.KERNEL_TAIL_ROWS = saved
    return PrefixHit(len(cold.prompt_token_ids), cached, same, times)


def _range(values: Sequence[float]) -> str:
    return (f"{min(values):.1f} / **{statistics.median(values):.1f}** / "
            f"{max(values):.1f}")


def render(hit: PrefixHit, threads: int) -> str:
    """The section `bench micro` prints."""
    lines = [f"\nPrefix-cache hit, embedded model in-process, {threads} threads: a "
             f"{hit.prompt_tokens}-token prompt again with {hit.cached_tokens} tokens cached, "
             "one output token; min / median / max over "
             f"{len(next(iter(hit.times.values())))} requests per path, alternating; greedy "
             f"output of the cached prompt {'equals' if hit.same_output else 'DIFFERS FROM'} "
             "the uncached one's on every path",
             "| the tail's path | wall ms | process CPU ms |", "|---|---|---|"]
    for name, values in hit.times.items():
        lines.append(f"| {name} | {_range([w for w, _ in values])} | "
                     f"{_range([c for _, c in values])} |")
    return "\n".join(lines)
