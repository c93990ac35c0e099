"""The markdown of the LiteLLM comparison (`litellm_peer.py`): one row per rate and mode,
both gateways side by side, and the issue's two goals against LiteLLM checked."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenyard.bench.gateway import Side

PAGE_SECTION = "## Side by side with LiteLLM's proxy (`make bench-peers`)"
TOKENYARD, LITELLM = "tokenyard", "LiteLLM"
GATEWAYS = (TOKENYARD, LITELLM)


@dataclass
class Point:
    """One gateway at one rate and mode in one round, and the direct run it is set
    against (the same round's)."""

    gateway: str
    round: int
    rate: float
    stream: bool
    direct: Side
    side: Side
    #: Gateway minus direct at mean, p50, p90, p99 (ms); None when either had no answer.
    added: dict[str, float] | None


def _mid(values: Sequence[float], fmt: str = "{:.1f}", spread: bool = True) -> str:
    if not values:
        return "-"
    mid = fmt.format(statistics.median(values))
    if len(values) == 1 or not spread:
        return mid
    return f"{mid} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def _others_pct(side: Side) -> float:
    """What processes outside the benchmark took during the run, % of the machine."""
    ours = (side.tokenyard_cpu_pct or 0) + side.client_cpu_pct + side.mock_cpu_pct
    return max(0.0, side.machine_cpu_pct - ours) / (os.cpu_count() or 1)


def _cells(points: Sequence[Point], saturated_at: float | None) -> dict[str, str]:
    if not points:
        return dict.fromkeys(("added", "cpu", "rss", "failed"),
                             "-" if saturated_at is None else f"(saturated at {saturated_at:g})")
    added = [p.added for p in points if p.added is not None]

    def of(pick: Callable[[Point], float | None]) -> list[float]:
        return [v for p in points if (v := pick(p)) is not None]

    return {
        "added": (f"{_mid([a['p50'] for a in added], '{:+.2f}')} / "
                  f"{_mid([a['p99'] for a in added], '{:+.1f}', spread=False)}"),
        "cpu": _mid(of(lambda p: p.side.tokenyard_cpu_ms_per_request), "{:.2f}"),
        "rss": _mid(of(lambda p: p.side.tokenyard_rss_mib), "{:.0f}", spread=False),
        "failed": f"{sum(p.side.report.failed for p in points)} / "
                  f"{sum(p.side.report.sent for p in points)}",
    }


def _p50(points: Sequence[Point]) -> float | None:
    values = [p.added["p50"] for p in points if p.added is not None]
    return statistics.median(values) if values else None


def figures_table(points: Sequence[Point], rates: Sequence[float],
                  saturated: Mapping[tuple[str, bool], float]) -> list[str]:
    """One row per mode and rate; medians over the rounds (min–max)."""
    lines = ["| mode | rate req/s | added p50 / p99 ms, tokenyard | LiteLLM | "
             "LiteLLM p50 / tokenyard p50 | CPU ms/req, tokenyard | LiteLLM | "
             "RSS MiB, tokenyard | LiteLLM | failed / sent, tokenyard | LiteLLM | "
             "others' CPU, % of the machine |", "|---" * 12 + "|"]
    for stream in (False, True):
        for rate in rates:
            at = {g: [p for p in points if p.gateway == g and p.rate == rate
                      and p.stream == stream] for g in GATEWAYS}
            if not any(at.values()):
                continue
            cells = {g: _cells(at[g], saturated.get((g, stream))) for g in GATEWAYS}
            ours, theirs = _p50(at[TOKENYARD]), _p50(at[LITELLM])
            ratio = (f"{theirs / ours:.1f}×" if ours and theirs and ours > 0 and theirs > 0
                     else "-")
            others = _mid([_others_pct(p.side) for g in GATEWAYS for p in at[g]], "{:.0f}",
                          spread=False)
            t, ll = cells[TOKENYARD], cells[LITELLM]
            lines.append(
                f"| {'stream' if stream else 'non-stream'} | {rate:g} | {t['added']} | "
                f"{ll['added']} | {ratio} | {t['cpu']} | {ll['cpu']} | {t['rss']} | "
                f"{ll['rss']} | {t['failed']} | {ll['failed']} | {others} |")
    return lines


def goals(points: Sequence[Point], rates: Sequence[float],
          saturated: Mapping[tuple[str, bool], float]) -> list[str]:
    """The issue's goals against LiteLLM: ≥ 10× less added p50 at 10 req/s, ≥ 5× its
    saturation rate."""
    lines = []
    for stream in (False, True):
        mode = "stream" if stream else "non-stream"
        at10 = {g: _p50([p for p in points if p.gateway == g and p.rate == 10
                         and p.stream == stream]) for g in GATEWAYS}
        ours, theirs = at10[TOKENYARD], at10[LITELLM]
        if ours is not None and theirs is not None:
            r = theirs / ours if ours > 0 else float("inf")
            lines.append(f"- {mode}, 10 req/s: LiteLLM adds {theirs:.2f} ms at p50, "
                         f"tokenyard {ours:.2f} ms: {r:.1f}× (goal ≥ 10×: "
                         f"{'met' if r >= 10 else 'not met'})")
        top = max(rates) if rates else 0.0
        theirs_sat, ours_sat = saturated.get((LITELLM, stream)), saturated.get((TOKENYARD, stream))
        if theirs_sat is None:
            lines.append(f"- {mode}: LiteLLM did not saturate up to {top:g} req/s")
            continue
        ours_text = (f"saturated at {ours_sat:g}" if ours_sat is not None
                     else f"did not saturate up to {top:g} req/s")
        factor = (ours_sat if ours_sat is not None else top) / theirs_sat
        lines.append(f"- {mode}: LiteLLM saturated at {theirs_sat:g} req/s, tokenyard "
                     f"{ours_text}: {'' if ours_sat is not None else '≥ '}{factor:.0f}× "
                     f"(goal ≥ 5×: {'met' if factor >= 5 else 'not met'})")
    return lines


def render_section(points: Sequence[Point], setup: Mapping[str, Any]) -> str:
    """The page section: how it was measured, the table, the goals (or why it was not)."""
    head = [PAGE_SECTION, "",
            "Written by `make bench-peers` (`tokenyard bench peers`; `--peers litellm` runs "
            f"this part alone). LiteLLM {setup['version']}'s proxy (`litellm[proxy]`, pinned, "
            "installed into a virtual environment of its own in the cache), one worker, a "
            "master key, no database; tokenyard with `serve --replica-url` and its defaults "
            "(API key, limits, billing, ledger, request log). Both in front of the same mock "
            "replica (16 tokens 1 ms apart, 64-word prompts), one run at a time: at each "
            "rate and mode straight to the mock, then through each gateway, the order "
            "flipping per point and per round. Added latency: a gateway's e2e minus the "
            "same round's direct e2e at that percentile. CPU per request and RSS: the "
            "gateway's process tree. Cells: the median over the rounds (min–max); p99 and "
            "RSS medians only. A gateway that failed over 1 % of its requests or added over "
            "100 ms at p50 (a queue building up) is saturated there, and its higher rates "
            "in that mode are not run.",
            ""]
    if "skipped" in setup:
        return "\n".join([*head, f"Not measured on this machine: {setup['skipped']}", ""])
    rates = setup["rates"]
    return "\n".join([
        *head,
        f"- machine: {setup['machine']}",
        f"- date: {setup['date']}; {setup['rounds']} round(s) of {setup['duration_s']:g} s "
        f"runs, {setup['measured_s'] / 60:.1f} min in all",
        "",
        *figures_table(points, rates, setup["saturated"]), "",
        "Against the issue's goals:", "",
        *goals(points, rates, setup["saturated"]), "",
    ])
