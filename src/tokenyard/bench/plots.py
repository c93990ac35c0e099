"""PNG plots of `tokenyard bench serve` runs: latency CDFs, throughput against concurrency,
and a waterfall of the mean Server-Timing stages.

Drawn with matplotlib's Agg canvas on explicit `Figure` objects: no pyplot, no display, no
global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tokenyard.bench.stats import Report, RequestRecord

#: (label, concurrency or None, records, report) of one load level.
Run = tuple[str, int | None, Sequence[RequestRecord], Report]


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def _latencies_ms(records: Sequence[RequestRecord], name: str) -> list[float]:
    done = [r for r in records if r.ok]
    if name == "ttft":
        return sorted(r.ttft_s * 1000 for r in done if r.ttft_s is not None)
    if name == "itl":
        return sorted(x * 1000 for r in done for x in r.itls_s)
    return sorted(r.e2e_s * 1000 for r in done)


def latency_cdfs(runs: Sequence[Run], path: Path) -> Path:
    """TTFT, ITL and e2e CDFs side by side, one line per level."""
    fig = Figure(figsize=(13, 4), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, (name, title) in zip(axes, [("ttft", "time to first token"),
                                         ("itl", "inter-token latency"),
                                         ("e2e", "end-to-end latency")], strict=True):
        for label, _, records, _ in runs:
            xs = _latencies_ms(records, name)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    return _save(fig, path)


def throughput_vs_concurrency(runs: Sequence[Run], path: Path) -> Path:
    """Output tokens/s and requests/s against the concurrency level, side by side."""
    points = sorted(((c, report) for _, c, _, report in runs if c is not None),
                    key=lambda p: p[0])
    xs = [c for c, _ in points]
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    for ax, title, ys in zip(fig.subplots(1, 2), ["output tokens/s", "requests/s"], [
        [r.output_token_rate for _, r in points], [r.request_rate for _, r in points],
    ], strict=True):
        ax.plot(xs, ys, "o-")
        ax.set_title(f"{title} against concurrency")
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(title)
        ax.set_xticks(xs)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def stage_waterfall(runs: Sequence[Run], path: Path) -> Path:
    """The mean Server-Timing stages of each level, each stage starting where the one
    before it ended (in the server's order)."""
    shown = [(label, report.server_timing_ms) for label, _, _, report in runs
             if report.server_timing_ms]
    fig = Figure(figsize=(8, 1.2 + 0.35 * sum(len(s) for _, s in shown) + 0.4 * len(shown)),
                 layout="constrained")
    axes = fig.subplots(len(shown), 1, squeeze=False, sharex=True)[:, 0]
    for ax, (label, stages) in zip(axes, shown, strict=True):
        names = list(stages)
        starts, at = [], 0.0
        for name in names:
            starts.append(at)
            at += stages[name]
        ax.barh(range(len(names)), [stages[n] for n in names], left=starts,
                color=[f"C{i % 10}" for i in range(len(names))])
        ax.set_yticks(range(len(names)), [f"{n} {stages[n]:.2f}" for n in names])
        ax.invert_yaxis()
        ax.set_title(f"mean Server-Timing stages, {label}", fontsize="medium")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("ms since the server received the request")
    return _save(fig, path)


def write_plots(runs: Sequence[Run], directory: Path) -> list[Path]:
    """Every plot the runs allow, as PNG files in `directory` (created); their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [latency_cdfs(runs, directory / "latency_cdf.png")]
    if sum(c is not None for _, c, _, _ in runs) > 1:
        paths.append(throughput_vs_concurrency(runs, directory / "throughput_concurrency.png"))
    if any(report.server_timing_ms for _, _, _, report in runs):
        paths.append(stage_waterfall(runs, directory / "stage_waterfall.png"))
    return paths
