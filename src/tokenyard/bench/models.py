"""`tokenyard bench models`: an on-demand model's load and its first request's TTFT
(`load = "on_demand"`, `balancer/on_demand.py`), against the goal of issue 39: the first
request's TTFT at most the warm load time + 1 s.

Each round serves a fleet of one on-demand deployment of the model (`tokenyard serve
--config`, no auth) and times, with the `openai` SDK, one streamed request to it:

- **cold**: a fresh model cache (`TOKENYARD_CACHE` in a new folder: the GGUF is read and
  converted again; the compiled kernels are linked in, they are not the model's load);
- **warm**: the usual cache, filled by a load before the first round;
- **reload**: in the warm server, the same model again after it unloaded itself when
  idle (`idle_unload_s`): what a model that comes back on demand costs.

The load time is the server's own figure (its "loaded … in N s" log line: replica process
started → serving → its model facts read); the TTFT is the client's (request sent → first
content chunk), so TTFT − load is what waiting for the load adds beyond the load itself.
Cold and warm alternate in order round by round, so a busy machine hurts both alike;
medians with min and max. A cold load converts the model again (minutes for the embedded
model on a CPU): only the first `--cold-rounds` rounds (1) have one.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai

from tokenyard.bench.children import Child, start_tokenyard
from tokenyard.config import default_cache_dir

DEPLOYMENT = "bench-on-demand"
#: What the banner shows for a default deployment loaded on demand (`cli/serve.py`).
_READY = re.compile(r"replica: (loaded on demand)")
_LOADED = re.compile(rf"loaded {DEPLOYMENT} in ([0-9.]+) s")
#: A replica's C++ kernel, compiled or found in the kernel cache (`engine/kernels/build.py`).
_KERNEL = re.compile(r"kernel \S+ ready in ([0-9.]+) s")
#: How long the warm server waits idle before the reload (its `idle_unload_s`).
IDLE_UNLOAD_S = 1.0
#: The goal's slack over the warm load time (issue 39).
GOAL_SLACK_S = 1.0


@dataclass
class Figures:
    """One way's loads and first-request TTFTs, in seconds, one per round."""

    load_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    #: Of each load, the seconds its replica spent building (or finding) its kernels: a
    #: build is a one-off of a kernel's source, not the model's load.
    kernel_s: list[float] = field(default_factory=list)

    def add(self, ttft_s: float, load: tuple[float, float]) -> None:
        self.ttft_s.append(ttft_s)
        self.load_s.append(load[0])
        self.kernel_s.append(load[1])

    @property
    def over_s(self) -> list[float]:
        """TTFT − load, per round: what the wait adds beyond the load."""
        return [t - load for t, load in zip(self.ttft_s, self.load_s, strict=True)]


def _fleet(folder: Path, model: str | None, threads: int) -> Path:
    path = folder / "fleet.toml"
    model_line = f'model = "{model}"\n' if model else ""
    path.write_text(f'[[deployments]]\nname = "{DEPLOYMENT}"\nreplicas = 1\n{model_line}'
                    f'load = "on_demand"\nidle_unload_s = {IDLE_UNLOAD_S}\n'
                    f'load_timeout_s = 600\nengine_args = ["--threads", "{threads}"]\n')
    return path


def _first_token_s(server: Child) -> float:
    """One streamed chat request's TTFT (to its first content chunk)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=600)
    began = time.perf_counter()
    stream = client.chat.completions.create(
        model=DEPLOYMENT, messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8, temperature=0, stream=True)
    ttft = None
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - began
    if ttft is None:
        raise RuntimeError("the first request produced no content")
    return ttft


def _last_load(server: Child) -> tuple[float, float]:
    """The last load the server logged: its seconds, and its replica's kernel seconds."""
    loads, kernels = [], 0.0
    for line in list(server.lines):
        if m := _KERNEL.search(line):
            kernels += float(m.group(1))
        elif m := _LOADED.search(line):
            loads.append((float(m.group(1)), kernels))
            kernels = 0.0
    return loads[-1]


def _status(server: Child) -> str | None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    card = client.models.retrieve(DEPLOYMENT)
    return getattr(card, "status", None)


def _serve(fleet: Path, cache: Path | None) -> Child:
    env = {"TOKENYARD_CACHE": str(cache)} if cache is not None else {}
    child, _ = start_tokenyard(None, auth=False, extra=["--config", str(fleet)],
                               env_extra=env, ready=_READY)
    return child


def _cold(fleet: Path, scratch: Path, out: Figures) -> None:
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=scratch))
    kernels = default_cache_dir() / "kernels"
    if kernels.exists():
        (cache / "kernels").symlink_to(kernels)
    server = _serve(fleet, cache)
    try:
        out.add(_first_token_s(server), _last_load(server))
    finally:
        server.stop()
        shutil.rmtree(cache, ignore_errors=True)


def _warm_and_reload(fleet: Path, warm: Figures, reload: Figures) -> None:
    server = _serve(fleet, None)
    try:
        warm.add(_first_token_s(server), _last_load(server))
        deadline = time.monotonic() + 120
        while _status(server) != "unloaded":
            if time.monotonic() > deadline:
                raise RuntimeError("the model did not unload when idle")
            time.sleep(0.1)
        reload.add(_first_token_s(server), _last_load(server))
    finally:
        server.stop()


def measure(rounds: int, model: str | None, threads: int,
            cold_rounds: int = 1) -> dict[str, Figures]:
    """`rounds` alternating rounds of warm and reload, the first `cold_rounds` of them with
    a cold one too (see the module)."""
    figures = {"cold": Figures(), "warm": Figures(), "reload": Figures()}
    scratch = Path(tempfile.mkdtemp(prefix="tokenyard-bench-models-"))
    try:
        fleet = _fleet(scratch, model, threads)
        _warm_and_reload(fleet, Figures(), Figures())  # fills the usual cache
        for i in range(rounds):
            ways = [lambda: _cold(fleet, scratch, figures["cold"]),
                    lambda: _warm_and_reload(fleet, figures["warm"], figures["reload"])]
            if i >= cold_rounds:  # a cold load converts the model again: minutes on a CPU
                ways = ways[1:]
            for way in ways if i % 2 == 0 else ways[::-1]:
                way()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return figures


def _cell(values: list[float]) -> str:
    return (f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"
            if values else "–")


def render(figures: dict[str, Figures], rounds: int) -> str:
    warm_load = statistics.median(figures["warm"].load_s)
    lines = [f"On-demand model: {rounds} alternating rounds ({len(figures['cold'].load_s)} "
             "cold), seconds, median (min–max)", "",
             "| way | load | of which kernels | first request TTFT | TTFT − load |",
             "|---|---|---|---|---|"]
    for name, f in figures.items():
        lines.append(f"| {name} | {_cell(f.load_s)} | {_cell(f.kernel_s)} | "
                     f"{_cell(f.ttft_s)} | {_cell(f.over_s)} |")
    lines.append("")
    for name in ("warm", "reload"):
        ttft = statistics.median(figures[name].ttft_s)
        met = ttft <= warm_load + GOAL_SLACK_S
        lines.append(f"goal ({name}): TTFT {ttft:.2f} s <= warm load {warm_load:.2f} s + "
                     f"{GOAL_SLACK_S:g} s: {'met' if met else 'NOT met'}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    parser.add_argument("--model", default=os.environ.get("TOKENYARD_BENCH_MODEL"),
                        help="the on-demand deployment's model (default: the embedded one)")
    parser.add_argument("--threads", type=int, default=1, help="its replica's threads (1)")
    parser.add_argument("--cold-rounds", type=int, default=1,
                        help="rounds with a cold load too (1: each converts the model again)")


def main(args: argparse.Namespace) -> int:
    print(render(measure(args.rounds, args.model, args.threads, args.cold_rounds),
                 args.rounds))
    return 0
