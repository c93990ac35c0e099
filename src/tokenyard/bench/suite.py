"""`tokenyard bench suite` (what `make bench` runs): the standard benchmarks in one go, and
docs/benchmarks.md rewritten from their output.

1. the engine alone (`bench offline`, which writes the page's head and engine table);
2. serving the embedded model through `tokenyard serve` with the gateway on
   (`bench serve`: a concurrency sweep, multi-turn conversations that share prefixes,
   long prompts), with latency CDFs, throughput against concurrency and the stage
   waterfall under docs/img/;
3. the gateway's overhead in front of a mock replica (`bench gateway`);
4. the balancer's policies side by side over 4 replicas (`bench fleet`);
5. grammar-constrained decoding against unconstrained at batch 16 (`bench grammar`);
6. moderation on (input and output, the local classifier) against off, one run each;
7. async scheduling off and on, served side by side at 1, 8 and 32 streams.
8. the Batch API's lane against the engine alone and beside live traffic (`bench batch`,
   which writes its own section).
9. the host path with a model that costs nothing, the engine alone and served
   (`bench host`).
10. n-gram speculative decoding on and off, one stream, an edit and a free answer
   (`bench spec`).
11. 8 LoRA adapters at once against the base model alone, one engine, the same
   concurrency (`bench lora`).

Each section names the machine, the versions and the exact command. The hand-written
"## Profile" part of the page is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from tokenyard.bench.children import start_tokenyard
from tokenyard.bench.host import cpu_model

PROFILE_MARKER = "\n## Profile"
SERVE_RUNS: list[tuple[str, list[str]]] = [
    ("Concurrency sweep: 256-token prompts, 64 output tokens",
     ["--concurrency", "1,4,16", "--requests", "16", "--input-len", "256",
      "--output-len", "64", "--ignore-eos", "--slo-ttft", "2000", "--slo-itl", "250"]),
    ("Multi-turn conversations sharing prefixes (prefix cache)",
     ["--workload", "multiturn", "--concurrency", "4", "--requests", "16",
      "--output-len", "32", "--ignore-eos"]),
    ("Long prompts (about 1,000 tokens)",
     ["--workload", "long", "--concurrency", "1", "--requests", "3", "--output-len", "16",
      "--ignore-eos"]),
]
#: One stream served, greedy, the lengths of `bench offline`'s one-stream figure.
STREAM_RUN = ["--concurrency", "1", "--requests", "3", "--input-len", "45", "--output-len",
              "128", "--ignore-eos", "--temperature", "0"]
#: A ~1,000-token prompt, sent twice with one seed: the second send is a prefix-cache hit.
CACHED_RUN = ["--concurrency", "1", "--requests", "1", "--input-len", "1000",
              "--output-len", "1", "--temperature", "0"]
#: Alternating rounds of the engine alone and the same figures served.
STREAM_ROUNDS = 2
GATEWAY_ARGS = ["--rates", "100,300,500", "--duration", "5"]
#: The LoRA goal's measure (issue 39): 3 alternating rounds, 8 streams, 8 adapters.
LORA_ARGS = ["--rounds", "3"]
#: The issue's goal is at 500 requests/s with 2 HTTP workers: beside 1, in one run.
GATEWAY_WORKERS_ARGS = ["--rates", "500", "--duration", "5", "--workers", "1,2"]
#: The observability issue's goal: logs and traces add ≤ 0.2 ms p50; the three side by side.
GATEWAY_TELEMETRY_ARGS = ["--rates", "100,200", "--duration", "5", "--telemetry",
                          "traces,logs,off"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--write", type=Path, default=Path("docs/benchmarks.md"),
                        help="the markdown page to rewrite")
    parser.add_argument("--img-dir", type=Path, default=Path("docs/img"),
                        help="where the plots go")
    parser.add_argument("--skip-offline", action="store_true",
                        help="keep the page's engine section; run serving and gateway only")
    parser.add_argument("--only", type=lambda v: [x.strip() for x in v.split(",")],
                        metavar="NAMES",
                        help=f"rerun only these sections ({', '.join(SECTIONS)}) and keep "
                        "the rest of the page as it is")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenyard.cli", *args]


def _shown(cmd: list[str]) -> str:
    """The command as a person would type it (`tokenyard …`)."""
    return "tokenyard " + " ".join(cmd[3:])


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{_shown(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout.strip()


def _machine(load: float | None = None) -> str:
    """The machine; `load`: the 1-minute load average before the section ran (default:
    now)."""
    load = os.getloadavg()[0] if load is None else load
    return (f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"aiohttp {version('aiohttp')}, tokenyard {version('tokenyard')}; 1-minute load "
            f"average {load:.2f} before the section ran")


def _section(title: str, runs: list[tuple[str, list[str], str]], intro: str,
             load: float | None = None) -> str:
    lines = [f"## {title}", "", intro, "", f"- machine: {_machine(load)}",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    for name, cmd, output in runs:
        lines += [f"### {name}", "", f"`{_shown(cmd)}`", "", output, ""]
    return "\n".join(lines)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _served_level(cmd: list[str], key: str | None, out: Path) -> dict[str, Any]:
    """Run one `bench serve` level and return its report (JSON)."""
    _run([*cmd, "--out", str(out), *(["--api-key", key] if key else [])])
    report: dict[str, Any] = json.loads(out.read_text())["levels"][0]["report"]
    return report


def served_vs_offline(url: str, key: str | None) -> tuple[str, list[list[str]]]:
    """One stream's decode rate and a repeated long prompt's TTFT: the engine alone
    (`bench offline --stream-only`, its own process) against `tokenyard serve` at `url`,
    in alternating rounds. Returns the table and the commands of its last round."""
    scratch = Path(tempfile.mkdtemp(prefix="tokenyard-bench-stream-"))
    rates: dict[str, list[float]] = {"offline": [], "served": []}
    cached: dict[str, list[float]] = {"offline": [], "served": []}
    cmds: list[list[str]] = []
    try:
        for r in range(STREAM_ROUNDS):
            offline = _cli("bench", "offline", "--stream-only", "--json",
                           str(scratch / "offline.json"))
            _run(offline)
            figures = json.loads((scratch / "offline.json").read_text())
            rates["offline"].append(figures[0]["value"])
            cached["offline"].append(figures[1]["value"])
            stream = _cli("bench", "serve", "--base-url", url, "--quiet", *STREAM_RUN,
                          "--seed", str(r))
            tpot = _served_level(stream, key, scratch / "stream.json")["tpot_ms"]["p50"]
            rates["served"].append(1000.0 / tpot)
            again = _cli("bench", "serve", "--base-url", url, "--quiet", *CACHED_RUN,
                         "--seed", str(1000 + r))
            _served_level(again, key, scratch / "cold.json")  # fills the prefix cache
            hit = _served_level(again, key, scratch / "again.json")
            cached["served"].append(hit["ttft_ms"]["p50"])
            cmds = [offline, stream, again]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rate = {k: _median(v) for k, v in rates.items()}
    ttft = {k: _median(v) for k, v in cached.items()}
    table = "\n".join([
        "| figure | engine alone | served (gateway on) | served / alone | goal |",
        "|---|---|---|---|---|",
        f"| one stream, decode tok/s (greedy, 45-token prompt, 128 out) | "
        f"{rate['offline']:.1f} | {rate['served']:.1f} | "
        f"{rate['served'] / rate['offline']:.0%} | >= 95 % |",
        f"| 1,000-token prompt sent again (prefix cache), TTFT ms | {ttft['offline']:.1f} | "
        f"{ttft['served']:.1f} | {ttft['served'] / ttft['offline']:.1f}x | served <= 20 ms |",
        "",
        f"Medians of {STREAM_ROUNDS} alternating rounds (the engine alone: medians of 3 "
        "repeats each). Served decode tok/s is 1000 / TPOT p50.",
    ])
    return table, cmds


def serving_section(img_dir: Path) -> str:
    """bench serve against `tokenyard serve` (embedded model, gateway on)."""
    child, key = start_tokenyard(None, auth=True)
    runs = []
    try:
        table, cmds = served_vs_offline(child.url + "/v1", key)
        runs.append(("One stream: served vs the engine alone", cmds[0],
                     "\n".join(f"`{_shown(c)}`" for c in cmds[1:]) + "\n\n" + table))
        for i, (name, extra) in enumerate(SERVE_RUNS):
            cmd = _cli("bench", "serve", "--base-url", child.url + "/v1", "--quiet",
                       *extra, *(["--plot-dir", str(img_dir)] if i == 0 else []))
            out = _run([*cmd, "--api-key", key] if key else cmd)
            runs.append((name, cmd, out))
    finally:
        child.stop()
    plots = "\n".join(f"![{p.stem}](img/{p.name})" for p in sorted(img_dir.glob("*.png")))
    intro = ("The embedded model behind `tokenyard serve` with its gateway on (API key, "
             "limits, ledger), streamed OpenAI chat requests. The API key is left out of "
             "the commands.")
    return _section("Serving the embedded model (`tokenyard bench serve`)", runs, intro) + (
        f"\n{plots}\n" if plots else "")


def gateway_section() -> str:
    """bench gateway: a mock replica direct vs through tokenyard."""
    cmd = _cli("bench", "gateway", *GATEWAY_ARGS, "--quiet")
    workers = _cli("bench", "gateway", *GATEWAY_WORKERS_ARGS, "--quiet")
    telemetry = _cli("bench", "gateway", *GATEWAY_TELEMETRY_ARGS, "--quiet")
    intro = ("What tokenyard's HTTP process (gateway on) adds in front of a mock replica "
             "that answers at once: the same open-loop load direct to the mock and through "
             "tokenyard, at each rate. Goal (gateway issue): ≤ 1 ms p50, ≤ 3 ms p99 at "
             "500 requests/s; the fleet issue: with `--workers 2`; the observability issue: "
             "logs and traces together ≤ 0.2 ms p50 more than with both off.")
    return _section("Gateway overhead (`tokenyard bench gateway`)",
                    [("Mock replica, direct vs through tokenyard", cmd, _run(cmd)),
                     ("One HTTP worker and two, side by side", workers, _run(workers)),
                     ("Telemetry off, logs, traces, side by side", telemetry,
                      _run(telemetry))], intro)


def fleet_section(output: str | None = None, load: float | None = None) -> str:
    """bench fleet: the balancer's policies over 4 replicas and several orgs, side by side;
    `output`: its report, from a run already made (`bench fleet --write`, whose load
    average before it is `load`), else it runs here."""
    cmd = _cli("bench", "fleet")
    intro = ("Several orgs, each with its own API key, system prompt and multi-turn "
             "conversations, over 4 replicas (one thread and a small KV pool each: the "
             "orgs' live prompts exceed one replica's pool and fit the four's) behind one "
             "`tokenyard serve --config` with its gateway on, under the precise, affinity (the "
             "default), least-loaded and round-robin policies in "
             "alternating rounds, with where each policy's misses come from; then the "
             "`precise` decision alone at 100,000 indexed blocks. Goals (issue 25), precise "
             "against round robin: hit rate ≥ 3×, TTFT p50 ≤ 0.6×, the `balance` stage ≤ 0.2 "
             "ms p50 at 100,000 indexed blocks.")
    return _section("The balancer (`tokenyard bench fleet`)",
                    [("Policies side by side, several orgs", cmd,
                      _run(cmd) if output is None else output)], intro, load)


def grammar_section() -> str:
    """bench grammar: constrained decoding beside unconstrained, in one engine."""
    cmd = _cli("bench", "grammar")
    intro = ("The engine alone, 16 requests at once, every one constrained by a JSON schema "
             "against none constrained, plus the grammar compiler's times. Goals "
             "(structured-output issue): constrained ≥ 90 % of unconstrained decode "
             "throughput; a typical tool schema compiles in ≤ 50 ms, cached after.")
    return _section("Constrained decoding (`tokenyard bench grammar`)",
                    [("Batch 16, all constrained vs none", cmd, _run(cmd))], intro)


#: One engine deployment of the embedded model; the moderated one checks input and output.
_MODERATION_FLEET = """
[[deployments]]
name = "{name}"
kind = "engine"
replicas = 1
{moderation}
"""
MODERATION_RUN = ["--concurrency", "8", "--requests", "16", "--input-len", "64",
                  "--output-len", "64", "--ignore-eos"]


def moderation_section() -> str:
    """bench serve against one server with moderation on and one with it off."""
    runs = []
    for name, moderation in (
            ("moderation-off", ""),
            ("moderation-on",
             'moderation = { input = "block", output = "block", classifier = "local" }')):
        scratch = Path(tempfile.mkdtemp(prefix="tokenyard-bench-moderation-"))
        fleet = scratch / "fleet.toml"
        fleet.write_text(_MODERATION_FLEET.format(name=name, moderation=moderation))
        child, key = start_tokenyard(None, auth=True, extra=["--config", str(fleet)])
        try:
            cmd = _cli("bench", "serve", "--base-url", child.url + "/v1", "--quiet",
                       "--model", name, *MODERATION_RUN)
            runs.append((name, cmd, _run([*cmd, "--api-key", key] if key else cmd)))
        finally:
            child.stop()
            shutil.rmtree(scratch, ignore_errors=True)
    intro = ("The embedded model behind `tokenyard serve --config`, once without moderation "
             "and once checking input and output with the local classifier (block mode: "
             "the output held back by its window until checked). Goals (structured-output "
             "issue): the `moderate` stage ≤ 2 ms p50; output checks ≤ 5 % of decode "
             "throughput. Compare the two tables' output tok/s; the `moderate` stage is in "
             "the Server-Timing means below the second.")
    return _section("Moderation (`tokenyard bench serve`, moderation on and off)", runs, intro)


#: Served under load with async scheduling off and on (engine/core.py): per level,
#: (concurrency, requests); both servers run, alternating, a fresh seed per round and level.
ASYNC_LEVELS = ((1, 4), (8, 16), (32, 32))
ASYNC_RUN = ["--input-len", "256", "--output-len", "64", "--ignore-eos"]
ASYNC_ROUNDS = 2


def async_scheduling_section() -> str:
    """bench serve against two servers, `--async-scheduling off` and `on`, alternating."""
    scratch = Path(tempfile.mkdtemp(prefix="tokenyard-bench-async-"))
    servers: dict[str, tuple[Any, str | None]] = {}
    reports: dict[tuple[str, int], list[dict[str, Any]]] = {}
    cmd: list[str] = []
    try:
        for mode in ("off", "on"):
            servers[mode] = start_tokenyard(None, auth=True,
                                            extra=["--async-scheduling", mode])
        for r in range(ASYNC_ROUNDS):
            for concurrency, requests in ASYNC_LEVELS:
                for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    child, key = servers[mode]
                    cmd = _cli("bench", "serve", "--base-url", child.url + "/v1", "--quiet",
                               "--concurrency", str(concurrency), "--requests", str(requests),
                               *ASYNC_RUN, "--seed", str(100 * r + concurrency))
                    report = _served_level(cmd, key, scratch / "level.json")
                    reports.setdefault((mode, concurrency), []).append(report)
    finally:
        for child, _ in servers.values():
            child.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    def fig(mode: str, c: int, key: str, sub: str | None = None) -> float:
        return _median([x[key][sub] if sub else x[key] for x in reports[(mode, c)]])

    rows = ["| streams | output tok/s off | on | on / off | TTFT p50 ms off | on | "
            "TPOT p50 ms off | on | errors off / on |", "|---|---|---|---|---|---|---|---|---|"]
    for c, _ in ASYNC_LEVELS:
        off, on = fig("off", c, "output_token_rate"), fig("on", c, "output_token_rate")
        errors = [sum(x["failed"] for x in reports[(m, c)]) for m in ("off", "on")]
        rows.append(
            f"| {c} | {off:.1f} | {on:.1f} | {on / off:.2f} | "
            f"{fig('off', c, 'ttft_ms', 'p50'):.0f} | {fig('on', c, 'ttft_ms', 'p50'):.0f} | "
            f"{fig('off', c, 'tpot_ms', 'p50'):.1f} | {fig('on', c, 'tpot_ms', 'p50'):.1f} | "
            f"{errors[0]} / {errors[1]} |")
    shown = [*cmd[:cmd.index("--base-url") + 1], "URL", *cmd[cmd.index("--base-url") + 2:]]
    intro = ("Two `tokenyard serve` (gateway on), one with `--async-scheduling off` and one "
             "with `on`, both up, measured in turn: the engine issue's item 3, whether "
             "planning each step while the one before computes pays on this machine. "
             f"Medians of {ASYNC_ROUNDS} alternating rounds, 256-token prompts, 64 out, a "
             "fresh seed per round and level (the same prompts to both).")
    return _section("Async scheduling off and on (`tokenyard bench serve`)",
                    [("Served, side by side", shown, "\n".join(rows))], intro)


def host_section() -> str:
    """bench host: the null model, the engine alone against served, alternating."""
    intro = ("The host path alone (issue 37): a model that computes nothing "
             "(engine/null_model.py) behind the real scheduler, KV manager, sampler, output "
             "processing, replica server, balancer and gateway (auth on, streamed). Goals, "
             "on this machine: the engine alone ≤ 30 µs of host time per sequence per step "
             "at 256 sequences and ≤ 1 ms per step at 1; served ≥ 80 % of the engine "
             "alone's tok/s at 256 streams and ≥ 95 % at 1.")
    return _one_run("host", "The host path", "Engine alone and served, a null model",
                    intro)


def spec_section() -> str:
    """bench spec: n-gram speculation on and off, one stream, side by side."""
    intro = ("n-gram prompt lookup (issue 39, `--speculative-config '{\"method\": "
             "\"ngram\", ...}'`), one stream of the embedded model with and without it, "
             "greedy (both produce the same tokens, checked every round). Goals: ≥ 1.6× on "
             "the edit (the reply repeats the prompt), ≥ 0.97× on the free answer (little "
             "to look up: speculation must not cost).")
    return _one_run("spec", "Speculative decoding", "n-gram on over off, one stream", intro)


def lora_section() -> str:
    """bench lora: 8 adapters at once against the base model alone, alternating."""
    intro = ("Multi-LoRA serving (issue 39): one engine of the embedded model with 8 random "
             "adapters resident (`--lora-modules`, `--max-loras 8`), 8 streams of the base "
             "model alone against 8 streams spread over the 8 adapters, the same tokens "
             "(EOS ignored), in alternating rounds. Goals: the adapters' aggregate tok/s "
             "≥ 70 % of the base model's; switching adapters takes no extra step.")
    return _one_run("lora", "LoRA adapters", "8 adapters at once against the base model",
                    intro, LORA_ARGS)


def _one_run(bench: str, title: str, name: str, intro: str,
             extra: list[str] | None = None) -> str:
    """The section of one `tokenyard bench <bench>` run, its output as it printed it."""
    cmd = _cli("bench", bench, *(extra or []))
    return _section(f"{title} (`tokenyard bench {bench}`)", [(name, cmd, _run(cmd))], intro)


#: The page's sections after the engine's, by name (`--only`).
SECTIONS: dict[str, Any] = {
    "serving": lambda args: serving_section(args.img_dir),
    "gateway": lambda args: gateway_section(),
    "fleet": lambda args: fleet_section(),
    "grammar": lambda args: grammar_section(),
    "moderation": lambda args: moderation_section(),
    "async": lambda args: async_scheduling_section(),
    "host": lambda args: host_section(),
    "spec": lambda args: spec_section(),
    "lora": lambda args: lora_section(),
    "batch": lambda args: _run(_cli("bench", "batch")) + "\n",
    "ray": lambda args: _run(_cli("bench", "ray")) + "\n",  # cli/ray_bench.py
}


def replace_section(text: str, section: str) -> str:
    """`text` with the section of the same `## ` title as `section` replaced by it (or,
    if it has none, `section` added before the profile)."""
    title = section.split("\n", 1)[0]
    start = text.find("\n" + title + "\n")
    if start < 0:
        head, marker, profile = text.partition(PROFILE_MARKER)
        return head.rstrip() + "\n\n" + section.rstrip() + "\n" + marker + profile
    end = text.find("\n## ", start + 1)
    end = len(text) if end < 0 else end
    return text[:start + 1] + section.rstrip() + "\n" + text[end:]


def main(args: argparse.Namespace) -> int:
    page: Path = args.write
    args.img_dir.mkdir(parents=True, exist_ok=True)
    if args.only:
        unknown = [n for n in args.only if n not in SECTIONS]
        if unknown:
            raise SystemExit(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
        for name in args.only:
            section = SECTIONS[name](args)
            # Read after the run (which can take long): edits made meanwhile stay.
            page.write_text(replace_section(page.read_text(), section))
        print(f"wrote {page}")
        return 0
    if not args.skip_offline:
        _run(_cli("bench", "offline", "--write", str(page)))
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    head, _, profile = text.partition(PROFILE_MARKER)
    engine = head.split("\n## Serving the embedded model", 1)[0].rstrip() + "\n"
    sections = [make(args) for make in SECTIONS.values()]
    page.write_text(engine + "\n" + "\n".join(sections)
                    + (PROFILE_MARKER + profile if profile else ""))
    print(f"wrote {page}")
    return 0
