"""The markdown of `tokenyard bench peers`: one table of figures side by side with the
ratio tokenyard / llama-server, the requests each phase sent and lost, and the section of
docs/benchmarks.md that the command owns.

The section goes after the hand-written "## Profile" part, which `make bench` keeps as it
is, so rewriting one page section never drops the other.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

PAGE_SECTION = "## Side by side with llama.cpp's llama-server (`make bench-peers`)"
#: `--model 1.7b`'s section (not a prefix of the embedded model's, nor it of this).
PAGE_SECTION_1_7B = ("## Side by side with llama-server on a 1.7B-parameter model "
                     "(`make bench-peers`)")
LLAMA, TOKENYARD = "llama-server", "tokenyard"


class PhaseLike(Protocol):
    """What the table reads of one phase's run (peers.PhaseRun)."""

    figures: dict[str, float]
    sent: int
    failed: int
    retried: int
    failures: dict[str, str]


def figure_rows(plan: Any) -> list[tuple[str, str, bool]]:
    """(key, label, higher is better) of each figure, in the table's order."""
    return [
        ("decode_tok_s", "one stream, decode tok/s", True),
        ("ttft_short_ms", f"TTFT, ~{plan.short_input}-token prompt, ms", False),
        ("ttft_long_ms", f"TTFT, ~{plan.long_input:,}-token prompt, ms", False),
        ("ttft_again_ms", "the same prompt again (prefix cache), TTFT ms", False),
        ("agg_8_tok_s", "aggregate output tok/s, 8 concurrent", True),
        ("ttft_8_p50_ms", "TTFT p50, 8 concurrent, ms", False),
        ("ttft_8_p99_ms", "TTFT p99, 8 concurrent, ms", False),
        ("agg_32_tok_s", "aggregate output tok/s, 32 concurrent", True),
        ("ttft_32_p50_ms", "TTFT p50, 32 concurrent, ms", False),
        ("ttft_32_p99_ms", "TTFT p99, 32 concurrent, ms", False),
        ("rss_8_mib", "server RSS peak, 8 concurrent, MiB", False),
        ("rss_32_mib", "server RSS peak, 32 concurrent, MiB", False),
        ("rss_8_engine_mib", "RSS peak of the process holding the model (tokenyard: its "
         "replica), 8 concurrent, MiB", False),
        ("rss_32_engine_mib", "the same, 32 concurrent, MiB", False),
    ]


def _num(value: float) -> str:
    return f"{value:.1f}" if abs(value) < 100 else f"{value:,.0f}"


def cell(values: Sequence[float]) -> str:
    """min / median / max of `values` (the median alone for one value; "-": none)."""
    if not values:
        return "-"
    mid = _num(statistics.median(values))
    if len(values) == 1:
        return mid
    return f"{_num(min(values))} / **{mid}** / {_num(max(values))}"


def round_ratios(rounds: Sequence[Mapping[str, Mapping[str, PhaseLike]]],
                 key: str) -> list[float]:
    """tokenyard / llama-server for figure `key` in each round that measured it on both."""
    out = []
    for one in rounds:
        ours, theirs = ([run.figures[key] for run in one.get(s, {}).values()
                         if key in run.figures] for s in (TOKENYARD, LLAMA))
        if ours and theirs and theirs[0]:
            out.append(ours[0] / theirs[0])
    return out


def ratio(ours: Sequence[float], theirs: Sequence[float], higher_better: bool,
          per_round: Sequence[float] = ()) -> str:
    """tokenyard's median over llama-server's, and which side it favours; with the range
    of the per-round ratios when there are several (does the lead hold in every round?)."""
    if not ours or not theirs or statistics.median(theirs) == 0:
        return "-"
    r = statistics.median(ours) / statistics.median(theirs)
    better = (r > 1) == higher_better
    text = f"{r:.2f} ({'tokenyard' if better else 'llama'} better)" if r != 1 else "1.00"
    if len(per_round) > 1:
        text += f"; rounds {min(per_round):.2f}–{max(per_round):.2f}"
    return text


def figures_table(values: Mapping[str, Mapping[str, Sequence[float]]], plan: Any,
                  rounds: Sequence[Mapping[str, Mapping[str, PhaseLike]]] = ()) -> str:
    """min / median / max per server and the ratio of the medians, one row per figure."""
    lines = ["| figure | llama-server min / **median** / max | "
             "tokenyard min / **median** / max | tokenyard / llama (medians) |",
             "|---|---|---|---|"]
    for key, label, higher in figure_rows(plan):
        ours, theirs = values[TOKENYARD].get(key, []), values[LLAMA].get(key, [])
        lines.append(f"| {label} | {cell(theirs)} | {cell(ours)} | "
                     f"{ratio(ours, theirs, higher, round_ratios(rounds, key))} |")
    return "\n".join(lines)


def requests_table(rounds: Sequence[Mapping[str, Mapping[str, PhaseLike]]]) -> str:
    """Requests sent / failed / retried on a fresh connection, per phase and server over
    all rounds, then each failure kind with an example, so a figure built on failures
    shows as such."""
    phases: list[str] = []
    for one in rounds:
        for by_phase in one.values():
            phases += [p for p in by_phase if p not in phases]
    lines = ["| phase | llama-server sent / failed / retried | "
             "tokenyard sent / failed / retried |", "|---|---|---|"]
    notes = []
    for phase in phases:
        cells = []
        for server in (LLAMA, TOKENYARD):
            runs = [one[server][phase] for one in rounds if phase in one.get(server, {})]
            cells.append(f"{sum(r.sent for r in runs)} / {sum(r.failed for r in runs)} / "
                         f"{sum(r.retried for r in runs)}")
            for i, run in enumerate(runs):
                notes += [f"- {server}, {phase}, round {i + 1}: {kind}: {text}"
                          for kind, text in run.failures.items()]
        lines.append(f"| {phase} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines + (["", "Failures:", "", *notes] if notes else []))


_OVERSUBSCRIBED = (
    "**The machine was shared** (a load average above its core count before, or other "
    "processes taking over a tenth of the CPU while it measured): other work shared the "
    "cores the servers' threads ran on. llama.cpp's threads wait for each other at every "
    "step, so one descheduled thread stalls the others: the figures then measure how each "
    "server bears contention more than its speed on an idle machine.")


def _few_rounds(done: int, wanted: int) -> str:
    return (f"**Only {done} round{'' if done == 1 else 's'}** (fewer than {wanted}): one "
            "lucky or unlucky round can move these medians; do not read a lead from them.")


def render_section(values: Mapping[str, Mapping[str, Sequence[float]]],
                   rounds: Sequence[Mapping[str, Mapping[str, PhaseLike]]],
                   setup: Mapping[str, Any], heading: str = PAGE_SECTION) -> str:
    """The page section under `heading`: how it was measured, the figures, the roofline
    (`setup["roofline"]`, markdown, where given), the requests."""
    plan = setup["plan"]
    build = ("the binary was cached" if setup["build_s"] < 60
             else f"it was built first, in {setup['build_s'] / 60:.1f} min")
    return "\n".join([
        heading, "",
        "Written by `make bench-peers`. Both servers on the same GGUF file, one at a time, "
        "alternating: each round runs every phase on one server and then on the other, "
        "the next round in the other order. Streamed OpenAI chat requests with "
        f"`ignore_eos`, {plan.output} tokens out (the long prompt: {plan.long_output}), "
        "from `tokenyard bench serve`'s client. Cells: min / median / max over the "
        "rounds. Ratios divide the medians (after them, the range of the ratio within "
        "each round); for times and memory below 1 favours "
        "tokenyard, for tok/s above 1 does. RSS sums the server's process tree (for "
        "tokenyard the HTTP process and its engine replica), sampled every 0.25 s.",
        "",
        f"- machine: {setup['machine']}",
        f"- date: {setup['date']}; {setup['rounds']} round"
        f"{'' if setup['rounds'] == 1 else 's'}, "
        f"{setup['measured_s'] / 60:.1f} min of measuring; {build}",
        f"- command: `{setup['command']}`",
        f"- model: {setup['model']}",
        f"- llama-server: {setup['llama']}",
        f"- tokenyard: {setup['tokenyard']}",
        f"- requests per round: one stream {plan.one_stream_requests} × "
        f"~{plan.short_input}-token prompts; the long prompt twice; "
        f"{plan.requests_8} at 8 concurrent, {plan.requests_32} at 32 (each phase stops "
        f"sending after {plan.phase_cap_s:.0f} s)",
        "",
        *([_OVERSUBSCRIBED, ""] if setup.get("oversubscribed") else []),
        *([_few_rounds(setup["rounds"], setup["min_rounds"]), ""]
          if setup["rounds"] < setup.get("min_rounds", 0) else []),
        figures_table(values, plan, rounds), "",
        *([setup["roofline"], ""] if setup.get("roofline") else []),
        requests_table(rounds), "",
    ])


def write_section(page: Any, section: str, heading: str = PAGE_SECTION) -> None:
    """Replace the page's section under `heading` with `section` (up to the next "## "
    heading), or append it at the end when the page has none."""
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    start = text.find(heading)
    if start < 0:
        page.write_text(text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n")
        return
    end = text.find("\n## ", start + len(heading))
    rest = text[end + 1:] if end >= 0 else ""
    page.write_text(text[:start] + section.rstrip("\n") + "\n" + ("\n" + rest if rest else ""))
