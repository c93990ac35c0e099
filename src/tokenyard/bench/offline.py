"""`tokenyard bench offline`: the engine alone, measured without HTTP.

Figures (each the median of --repeats runs): offline throughput over a batch of prompts,
one stream's decode rate, a long prompt's time to first token cold and cached, warm start
to first token, the replica's RSS and where it goes, int8 agreement with float32, and
transformers on the same weights in the same run for comparison.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tokenyard.bench.host import Figure, cpu_model
from tokenyard.engine.frontend import Frontend
from tokenyard.engine.llm import LLM
from tokenyard.engine_args import engine_kwargs
from tokenyard.wire.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=50)
    parser.add_argument("--max-prompt-len", type=int, default=500)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--long-prompt-len", type=int, default=1000)
    parser.add_argument("--agreement-prompts", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the short figures")
    parser.add_argument("--throughput-repeats", type=int, default=2)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-int8", action="store_true")
    parser.add_argument("--compare-weights", default="q8_0,q4_1",  # float32 always joins
                        help="weight formats whose one-stream decode is measured in the same "
                        "rounds as the engine's own (comma-separated; '' for none)")
    parser.add_argument("--decode-only", action="store_true",
                        help="only the one-stream decode figures (and --compare-weights)")
    parser.add_argument("--stream-only", action="store_true",
                        help="only one stream's decode rate and the long prompt's cached "
                             "time to first token (what `bench suite` sets beside the "
                             "served figures)")
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    parser.add_argument("--write", type=Path, help="rewrite this markdown report")


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of uniformly drawn lengths in [lo, hi] and token ids (no shared prefixes)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(max_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def median_of(repeats: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(repeats))


def stream_one(frontend: Frontend, prompt_ids: list[int], params: SamplingParams) -> list[float]:
    """Run one request alone; return the monotonic time of each output token."""
    request_id = f"bench-{time.monotonic_ns()}"
    frontend.add_request(request_id, prompt_ids, params)
    times: list[float] = []
    while frontend.has_work:
        for out in frontend.step():
            times.extend(time.perf_counter() for d in out.deltas for _ in d.token_ids)
    return times


def throughput(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """(output tokens/s, all tokens/s) for the whole batch generated at once."""
    llm.core.kv.pool.reset_prefix_cache()
    start = time.perf_counter()
    results = llm.generate(prompts, greedy(output_len))
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(r.token_ids) for r in results)
    in_tokens = sum(len(p) for p in prompts)
    return out_tokens / elapsed, (out_tokens + in_tokens) / elapsed


def decode_rate(llm: LLM, prompt: list[int], output_len: int) -> float:
    times = stream_one(llm.frontend, prompt, greedy(output_len))
    return (len(times) - 1) / (times[-1] - times[0])


def process_rss() -> tuple[int, int, int]:
    """This process's resident bytes: total, anonymous, file-backed (/proc/self/status)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:")):
                name, kib = line.split()[:2]
                fields[name] = int(kib) * 1024
    return fields["VmRSS:"], fields["RssAnon:"], fields["RssFile:"]


def replica_memory(llm: LLM, rss_before: int, load: int) -> Figure:
    """The replica's RSS after a load, and where it goes: weights kept, KV pool, imports."""
    from tokenyard.engine.kernels.blocks import BlockWeight

    core = llm.frontend.core
    model = core.runner.model
    blocks = {id(v): v for m in model.modules() for v in vars(m).values()
              if isinstance(v, BlockWeight)}
    floats = sum(t.nbytes for t in model.parameters()) + sum(t.nbytes for t in model.buffers())
    attention = core.runner.attention
    total, anon, file = process_rss()
    mb = 1e6
    return Figure(
        f"replica RSS after the throughput runs ({load} requests at once)", total / mb, "MB",
        note=f"anonymous {anon / mb:.0f} MB, file-backed {file / mb:.0f} MB; before the "
        f"engine loaded (Python, torch, imports) {rss_before / mb:.0f} MB; weights kept: "
        f"{sum(b.nbytes for b in blocks.values()) / mb:.0f} MB in blocks + {floats / mb:.0f} "
        f"MB {next(model.parameters()).dtype}; KV pool resident "
        f"{attention.resident_bytes() / mb:.0f} MB of its {attention.nbytes / mb:.0f} MB "
        "budget",
    )


def long_prompt_ttft(llm: LLM, prompt: list[int]) -> tuple[float, float]:
    """Time to first token of a long prompt, cold (empty prefix cache) and cached."""
    llm.core.kv.pool.reset_prefix_cache()
    start = time.perf_counter()
    cold = stream_one(llm.frontend, prompt, greedy(1))[0] - start
    start = time.perf_counter()
    cached = stream_one(llm.frontend, prompt, greedy(1))[0] - start
    return cold, cached


def warm_start_to_first_token(extra: list[str]) -> float:
    """Seconds from spawning `tokenyard generate` (load cache present) to its first token."""
    cmd = [sys.executable, "-m", "tokenyard.cli", "generate", "Hello", "--max-tokens", "2",
           *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    proc.stdout.read(1)
    elapsed = time.perf_counter() - start
    proc.wait()
    return elapsed


def int8_agreement(f32: LLM, i8: LLM, prompts: list[Any], max_tokens: int) -> tuple[float, float]:
    """(share of prompts whose greedy continuation is identical, share of tokens equal
    before the first divergence) — int8 weights against float32."""
    a = f32.generate(prompts, greedy(max_tokens))
    b = i8.generate(prompts, greedy(max_tokens))
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))
    prefix = 0.0
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x.token_ids), len(y.token_ids)) and x.token_ids[n] == y.token_ids[n]:
            n += 1
        prefix += n / max(len(x.token_ids), 1)
    return same / len(prompts), prefix / len(prompts)


def agreement_prompts(n: int) -> list[list[dict[str, str]]]:
    subjects = ["the sea", "a compiler", "bread", "the moon", "a violin", "rain", "chess",
                "a bicycle", "volcanoes", "honeybees"]
    asks = ["Write one sentence about", "Explain briefly", "List three facts about",
            "Give a short poem about", "What is interesting about", "Describe",
            "Tell a child about", "Summarise the history of", "Compare cats with",
            "Name a use of"]
    return [[{"role": "user", "content": f"{asks[i % 10]} {subjects[i // 10 % 10]}."}]
            for i in range(n)]


def run(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> list[Figure]:
    figures: list[Figure] = []
    rss_before = process_rss()[0]
    llm = LLM(show_progress=True, **engine_kwargs)
    vocab = llm.frontend.model_config.vocab_size
    prompts = random_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab)
    llm.generate(prompts[:2], greedy(4))  # warm-up
    short = random_prompts(1, 45, 45, vocab, seed=1)[0]
    if args.decode_only:
        return decode_side_by_side(llm, args, engine_kwargs, short)
    if args.stream_only:
        return stream_figures(llm, args, short)
    runs = [throughput(llm, prompts, args.output_len) for _ in range(args.throughput_repeats)]
    figures.append(Figure(
        f"offline throughput, {args.num_prompts} prompts ({args.min_prompt_len}-"
        f"{args.max_prompt_len} tokens), {args.output_len} out, greedy, ignore_eos",
        statistics.median(r[0] for r in runs), "output tok/s", ">= 200",
        f"all tokens (prompt + output): {statistics.median(r[1] for r in runs):.0f} tok/s",
    ))
    figures.append(replica_memory(llm, rss_before, args.num_prompts))
    rate = median_of(args.repeats, lambda: decode_rate(llm, short, args.output_len))
    figures.append(Figure("one stream, decode", rate, "tok/s", ">= 80"))
    long = random_prompts(1, args.long_prompt_len, args.long_prompt_len, vocab, seed=2)[0]
    ttfts = [long_prompt_ttft(llm, long) for _ in range(args.repeats)]
    figures.append(Figure(f"{args.long_prompt_len}-token prompt, time to first token",
                          statistics.median(t[0] for t in ttfts), "s", "<= 3.5"))
    figures.append(Figure(f"{args.long_prompt_len}-token prompt again (prefix cached)",
                          statistics.median(t[1] for t in ttfts) * 1000, "ms", "<= 20"))
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in engine_kwargs.items()]
    start_s = median_of(args.repeats, lambda: warm_start_to_first_token(extra))
    figures.append(Figure("warm start (load cache present) to first token", start_s, "s",
                          "<= 3"))
    if not args.skip_int8 and engine_kwargs.get("weights") != "int8":
        i8 = LLM(show_progress=False, **{**engine_kwargs, "weights": "int8"})
        i8.generate(prompts[:2], greedy(4))
        rate8 = median_of(args.repeats, lambda: decode_rate(i8, short, args.output_len))
        figures.append(Figure("one stream, decode, int8 weights", rate8, "tok/s", ">= 80"))
        exact, prefix = int8_agreement(llm, i8, agreement_prompts(args.agreement_prompts), 32)
        figures.append(Figure(
            f"int8 greedy agreement with float32, {args.agreement_prompts} chat prompts x 32 "
            "tokens", exact * 100, "% identical",
            note=f"{prefix * 100:.1f}% of tokens before the first divergence",
        ))
    figures += decode_side_by_side(llm, args, engine_kwargs, short)[1:]
    if not args.skip_transformers:
        from tokenyard.bench.reference import transformers_figures

        figures += transformers_figures(llm, prompts, short, long, args)
    return figures


def stream_figures(llm: LLM, args: argparse.Namespace, short: list[int]) -> list[Figure]:
    """One stream's decode rate and a long prompt's TTFT when it is sent again (its
    prefix cached): the two figures the served path is held to."""
    rate = median_of(args.repeats, lambda: decode_rate(llm, short, args.output_len))
    vocab = llm.frontend.model_config.vocab_size
    long = random_prompts(1, args.long_prompt_len, args.long_prompt_len, vocab, seed=2)[0]
    cached = statistics.median(long_prompt_ttft(llm, long)[1] for _ in range(args.repeats))
    return [Figure("one stream, decode", rate, "tok/s", ">= 80"),
            Figure(f"{args.long_prompt_len}-token prompt again (prefix cached)",
                   cached * 1000, "ms", "<= 20")]


def decode_side_by_side(
    llm: LLM, args: argparse.Namespace, engine_kwargs: dict[str, Any], prompt: list[int]
) -> list[Figure]:
    """One-stream decode of `llm` and of the same engine in each --compare-weights format,
    measured in alternating rounds (medians of --repeats): [own rate, then one per format]."""
    own = llm.frontend.weights  # what `auto` (or the flag) resolved to
    asked = [w.strip() for w in args.compare_weights.split(",") if w.strip()]
    # float32 is always the reference beside a block format.
    formats = [w for w in dict.fromkeys([*asked, "float32"]) if w != own]
    engines = {own: llm}
    for w in formats:
        engines[w.strip()] = LLM(show_progress=False, **{**engine_kwargs, "weights": w.strip()})
        engines[w.strip()].generate([prompt], greedy(4))  # warm-up (kernel build, caches)
    rates: dict[str, list[float]] = {w: [] for w in engines}
    for _ in range(args.repeats):
        for w, engine in engines.items():
            rates[w].append(decode_rate(engine, prompt, args.output_len))
    base = statistics.median(rates[own])
    figures = [Figure(f"one stream, decode, {own} weights (rounds alternating with "
                      f"{', '.join(formats) or 'nothing'})", base, "tok/s", ">= 80")]
    for w in engines:
        if w == own:
            continue
        rate = statistics.median(rates[w])
        figures.append(Figure(f"one stream, decode, {w} weights", rate, "tok/s", ">= 80",
                              f"{rate / base:.2f}x {own} in the same rounds"))
    return figures


def machine() -> str:
    import os

    cpu = cpu_model()
    load = os.getloadavg()[0]
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}; "
            f"1-minute load average {load:.2f} when the report was written")


def render_markdown(figures: list[Figure], command: str) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench`; every figure is from the command below, in one run on one",
        "machine. Medians of repeats; compare ratios within a table, not across machines.",
        "",
        "## Engine, offline (`tokenyard bench offline`)",
        "",
        f"- machine: {machine()}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- command: `{command}`",
        "",
        "| figure | value | unit | goal | note |",
        "|---|---|---|---|---|",
    ]
    for f in figures:
        value = f"{f.value:.3g}" if f.value < 100 else f"{f.value:.0f}"
        lines.append(f"| {f.name} | {value} | {f.unit} | {f.goal} | {f.note} |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    figures = run(args, engine_kwargs(args))
    command = "tokenyard " + " ".join(sys.argv[1:])
    for f in figures:
        print(f"{f.name}: {f.value:.4g} {f.unit}  (goal {f.goal or '-'}) {f.note}")
    if args.json:
        args.json.write_text(json.dumps([asdict(f) for f in figures], indent=2))
    if args.write:
        report = render_markdown(figures, command)
        existing = args.write.read_text() if args.write.exists() else ""
        marker = "\n## Profile"
        keep = existing[existing.index(marker):] if marker in existing else ""
        args.write.write_text(report + keep)
    return 0
