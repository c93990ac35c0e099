"""Where `tokenyard bench host`'s time goes, by stage: cProfile over the engine alone's
steps (in this process) and over the gateway process's event loop while it serves the
null model (``python -m cProfile`` around ``tokenyard serve``, which writes its statistics
when serve stops; it sees the main thread only, the one that reads the replica's frames
and writes the streams).

Engine stages are inclusive times of the functions that start them; the gateway's are
self times grouped by the package they run in. cProfile's own overhead inflates both, so
the shares count, not the absolute times.
"""

from __future__ import annotations

import asyncio
import cProfile
import pstats
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Engine stage -> the functions (file suffix, name) whose inclusive time it is.
ENGINE_STAGES: dict[str, Sequence[tuple[str, str]]] = {
    "schedule": [("engine/scheduler.py", "schedule")],
    "input preparation": [("engine/runner.py", "prepare")],
    "forward (the null model)": [("engine/null_model.py", "forward"),
                                 ("engine/null_model.py", "compute_logits")],
    # The batch's metadata is the runner's, made from the params only when the rows
    # sampled change (sample/metadata.py's from_params, inside it).
    "sample (batch metadata + sampler)": [("engine/runner.py", "_sampling_batch"),
                                          ("sample/sampler.py", "__call__")],
    "outputs (core)": [("engine/core.py", "_outputs")],
    "output processing (with detokenize)": [("text/output_processor.py", "process")],
    "detokenize": [("text/detokenizer.py", "push"), ("text/detokenizer.py", "flush")],
}
#: Gateway stage -> path fragments of the files whose self time it is (first match).
GATEWAY_STAGES: Sequence[tuple[str, Sequence[str]]] = (
    ("replica->gateway (balancer, wire)", ("tokenyard/balancer/", "tokenyard/wire/")),
    ("SSE and chunk JSON (api)", ("tokenyard/api/",)),
    ("gateway (auth, limits, billing, pipeline)", ("tokenyard/gateway/",)),
    ("text (detokenize, parsers)", ("tokenyard/text/",)),
    ("json", ("json/", "{built-in method _json")),
    ("aiohttp", ("aiohttp/",)),
    ("asyncio and sockets", ("asyncio/", "selectors", "socket")),
)

#: Self time that is not serving: the event loop's wait for sockets, the start's imports.
LEFT_OUT = ("select.epoll", "<frozen importlib", "marshal", "{built-in method builtins.exec}",
            "{built-in method builtins.compile}", "{built-in method _imp.")


def _inclusive(stats: pstats.Stats, targets: Sequence[tuple[str, str]]) -> float:
    raw = stats.stats  # type: ignore[attr-defined]
    return sum(entry[3] for (path, _, name), entry in raw.items()
               if any(path.endswith(f) and name == fn for f, fn in targets))


def engine_stages(stats: pstats.Stats) -> list[tuple[str, float]]:
    """(stage, seconds) for ENGINE_STAGES, then the whole of `Frontend.step`."""
    rows = [(stage, _inclusive(stats, targets)) for stage, targets in ENGINE_STAGES.items()]
    return [*rows, ("whole step (Frontend.step)",
                    _inclusive(stats, [("engine/frontend.py", "step")]))]


def gateway_stages(stats: pstats.Stats) -> tuple[list[tuple[str, float]], float]:
    """(stage, self seconds) for GATEWAY_STAGES, the rest as "other"; and the seconds
    left out: waiting in epoll (idle) and the start's imports."""
    totals = dict.fromkeys([s for s, _ in GATEWAY_STAGES] + ["other"], 0.0)
    left_out = 0.0
    for (path, _, name), entry in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{path} {name}"
        if any(f in where for f in LEFT_OUT):
            left_out += entry[2]
            continue
        stage = next((s for s, frags in GATEWAY_STAGES if any(f in where for f in frags)),
                     "other")
        totals[stage] += entry[2]
    return list(totals.items()), left_out


def _table(title: str, rows: list[tuple[str, float]], total: float) -> list[str]:
    lines = [f"| {title} | s | share |", "|---|---|---|"]
    lines += [f"| {stage} | {s:.3f} | {s / total:.0%} |" for stage, s in rows if total > 0]
    return lines


def profile_stages(n: int, input_len: int, output_len: int, harness: Any) -> list[str]:
    """The stage tables (markdown lines) for `n` sequences / streams; `harness`: the
    module `bench/host_path.py` (its null_llm, engine_run, start_server, served_run)."""
    null_llm, engine_run = harness.null_llm, harness.engine_run
    start_server, served_run = harness.start_server, harness.served_run
    llm = null_llm(n)
    try:
        engine_run(llm, 2, 8, 4, seed=-2)
        profiler = cProfile.Profile()
        profiler.enable()
        engine_run(llm, n, input_len, output_len, seed=-3)
        profiler.disable()
    finally:
        llm.frontend.core.close()
    engine = engine_stages(pstats.Stats(profiler))
    scratch = Path(tempfile.mkdtemp(prefix="tokenyard-bench-host-"))
    out = scratch / "gateway.prof"
    try:
        child, key = start_server(n, python=["-m", "cProfile", "-o", str(out)])
        try:
            asyncio.run(served_run(child, key, n, input_len, output_len, seed=-4))
        finally:
            child.stop()
        gateway, left_out = (gateway_stages(pstats.Stats(str(out))) if out.exists()
                             else ([], 0.0))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lines = [f"Where the time goes at {n} (cProfile; engine: inclusive times of one run "
             "in this process, stages nest: output processing holds detokenize; gateway: "
             "self times of its event loop over one served run):", ""]
    lines += _table("engine stage", engine, engine[-1][1])
    if gateway:
        lines += ["", *_table("gateway stage", gateway, sum(s for _, s in gateway)),
                  "", f"(left out of the gateway's shares: {left_out:.2f} s waiting in "
                  "epoll or importing at its start)"]
    else:
        lines += ["", "(the gateway's profile was not written)"]
    return lines
