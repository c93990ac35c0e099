"""`tokenyard bench batch`: the Batch API's lane against the engine alone, and beside live
traffic (issue 23).

One `tokenyard serve` of the embedded model (gateway on; its lane runs
--batch-concurrency lines at once) and, in this process, the same engine alone. Each of
--rounds rounds runs, in turn:

1. **engine alone**: the round's prompts (random token ids of --min/--max-prompt-len,
   greedy, --output-len tokens, ignore_eos) generated at once, as `bench offline`'s
   throughput figure does: output tokens/s;
2. **batch alone**: the same prompts as one `/v1/completions` batch of --lines lines
   (token-id prompts, the same sampling), timed from its creation until it is
   `completed`: its lines' output tokens/s;
3. **live alone**: --live-requests streamed chat requests, --live-concurrency at a time:
   their time to first token;
4. **live beside a batch**: the same live requests while a batch of other prompts runs
   (cancelled once they are done: the time from the cancel until the batch is
   `cancelled`, its lines in flight cut, is the round's cancel figure).

It reports the medians over rounds with their min and max, the figures the issue holds
the lane to (batch / engine alone ≥ 0.9; live TTFT p50 beside the batch / alone ≤ 1.2; a
cancelled batch ends within 5 s), and per round the share of the machine's CPU that
other processes took (a busy, shared machine shows there, not in the figures' names).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tokenyard.bench.children import start_tokenyard
from tokenyard.bench.host import cpu_model
from tokenyard.bench.proctree import machine_busy_s, sample_tree
from tokenyard.bench.stats import percentile

TITLE = "## The Batch API (`tokenyard bench batch`)"
LIVE_PROMPTS = ["the sea", "a compiler", "bread", "the moon", "a violin", "rain", "chess"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lines", type=int, default=1000, help="lines of each batch")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--min-prompt-len", type=int, default=50)
    parser.add_argument("--max-prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--batch-concurrency", type=int, default=128,
                        help="lines the server's lane runs at once "
                        "(TOKENYARD_BATCH_CONCURRENCY)")
    parser.add_argument("--live-requests", type=int, default=16)
    parser.add_argument("--live-concurrency", type=int, default=2)
    parser.add_argument("--live-output-len", type=int, default=16)
    parser.add_argument("--quick", action="store_true",
                        help="a short run: 100 lines, 2 rounds, 8 live requests (unless set)")
    parser.add_argument("--json", type=Path, help="write the rounds' figures as JSON here")
    parser.add_argument("--write", type=Path, help="replace this page's batch section")


@dataclass
class Round:
    offline_tps: float = 0.0
    batch_tps: float = 0.0
    ttft_alone_ms: float = 0.0
    ttft_beside_ms: float = 0.0
    #: Live requests that ended while the batch beside them was still running.
    overlapped: int = 0
    #: Seconds from the cancel of the batch beside them to its end (-1: it had ended).
    cancel_s: float = -1.0
    #: Other processes' CPU, % of the machine, per phase.
    others_pct: dict[str, float] = field(default_factory=dict)


class Phase:
    """Wall time of a phase and the share of the machine's CPU outside this process tree
    (this process, the in-process engine, the server and its replica) meanwhile."""

    def __init__(self, rnd: Round, name: str) -> None:
        self.rnd, self.name = rnd, name

    def __enter__(self) -> Phase:
        self.busy, self.tree = machine_busy_s(), sample_tree(os.getpid())
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.start
        ours = sample_tree(os.getpid()).cpu_s - self.tree.cpu_s
        other = max(0.0, machine_busy_s() - self.busy - ours)
        self.rnd.others_pct[self.name] = 100 * other / (wall * (os.cpu_count() or 1))


class Server:
    """The Batch API and chat of the `tokenyard serve` at `url`."""

    def __init__(self, session: aiohttp.ClientSession, url: str, key: str | None) -> None:
        self.session, self.url = session, url
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def call(self, method: str, path: str, **kw: Any) -> Any:
        async with self.session.request(method, self.url + path, headers=self.headers,
                                        **kw) as r:
            if r.status != 200:
                raise RuntimeError(f"{method} {path}: {r.status} {await r.text()}")
            return await r.json() if r.content_type == "application/json" else await r.read()

    async def create(self, model: str, prompts: list[list[int]], output_len: int) -> str:
        lines = "".join(json.dumps({
            "custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": p, "max_tokens": output_len,
                     "temperature": 0, "ignore_eos": True}}) + "\n"
            for i, p in enumerate(prompts))
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", lines.encode(), filename="bench.jsonl")
        file = await self.call("POST", "/v1/files", data=form)
        batch = await self.call("POST", "/v1/batches", json={
            "input_file_id": file["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"})
        return str(batch["id"])

    async def ended(self, batch_id: str) -> dict[str, Any]:
        while True:
            batch = await self.call("GET", f"/v1/batches/{batch_id}")
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                return dict(batch)
            await asyncio.sleep(0.1)

    async def output_tokens(self, batch: dict[str, Any]) -> int:
        if not batch.get("output_file_id"):
            raise RuntimeError(f"batch {batch['id']} ended {batch['status']} with no output")
        if batch.get("error_file_id"):
            errors = await self.call("GET", f"/v1/files/{batch['error_file_id']}/content")
            raise RuntimeError(f"batch {batch['id']} had failed lines: {errors[:500]!r}")
        content = await self.call("GET", f"/v1/files/{batch['output_file_id']}/content")
        return sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
                   for line in content.decode().splitlines())

    async def ttft_ms(self, model: str, i: int, output_len: int) -> float:
        """One streamed chat request: ms until its first token's chunk."""
        start = time.perf_counter()
        body = {"model": model, "stream": True, "max_tokens": output_len,
                "temperature": 0, "messages": [{"role": "user", "content":
                f"Write about {LIVE_PROMPTS[i % len(LIVE_PROMPTS)]} ({i})."}]}
        first = None
        async with self.session.post(self.url + "/v1/chat/completions", json=body,
                                     headers=self.headers) as r:
            if r.status != 200:
                raise RuntimeError(f"live request: {r.status} {await r.text()}")
            async for raw in r.content:
                line = raw.decode().strip()
                if first is None and line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    if delta.get("content"):
                        first = time.perf_counter()
        return 1000 * ((first or time.perf_counter()) - start)

    async def live(self, model: str, n: int, concurrency: int, output_len: int,
                   ) -> list[tuple[float, float]]:
        """(TTFT ms, end time) of `n` live requests, `concurrency` at a time."""
        queue = list(range(n))
        out: list[tuple[float, float]] = []

        async def worker() -> None:
            while queue:
                ttft = await self.ttft_ms(model, queue.pop(0), output_len)
                out.append((ttft, time.perf_counter()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return out


def _prompts(args: argparse.Namespace, vocab: int, seed: int) -> list[list[int]]:
    from tokenyard.bench.offline import random_prompts

    return random_prompts(args.lines, args.min_prompt_len, args.max_prompt_len, vocab, seed)


async def one_round(args: argparse.Namespace, llm: Any, server: Server, model: str,
                    r: int) -> Round:
    from tokenyard.bench.offline import throughput

    rnd = Round()
    vocab = llm.frontend.model_config.vocab_size
    prompts = _prompts(args, vocab, seed=r)
    with Phase(rnd, "offline"):
        rnd.offline_tps = throughput(llm, prompts, args.output_len)[0]
    with Phase(rnd, "batch"):
        start = time.perf_counter()
        batch = await server.ended(await server.create(model, prompts, args.output_len))
        wall = time.perf_counter() - start
    rnd.batch_tps = await server.output_tokens(batch) / wall
    live = (model, args.live_requests, args.live_concurrency, args.live_output_len)
    with Phase(rnd, "live"):
        alone = await server.live(*live)
    rnd.ttft_alone_ms = percentile([t for t, _ in alone], 50)
    beside_id = await server.create(model, _prompts(args, vocab, seed=1000 + r),
                                    args.output_len)
    with Phase(rnd, "live + batch"):
        await asyncio.sleep(0.5)  # the lane has claimed its first lines
        beside = await server.live(*live)
        still = await server.call("GET", f"/v1/batches/{beside_id}")
    rnd.ttft_beside_ms = percentile([t for t, _ in beside], 50)
    rnd.overlapped = len(beside) if still["status"] == "in_progress" else -1
    cancelled = time.perf_counter()
    with contextlib.suppress(RuntimeError):  # 409: it ended meanwhile
        await server.call("POST", f"/v1/batches/{beside_id}/cancel")
    if (await server.ended(beside_id))["status"] == "cancelled":
        rnd.cancel_s = time.perf_counter() - cancelled
    return rnd


async def run(args: argparse.Namespace) -> tuple[list[Round], str]:
    from tokenyard.bench.offline import greedy
    from tokenyard.engine.llm import LLM

    llm = LLM(show_progress=False)
    llm.generate([[100] * 8], greedy(4))  # warm-up
    # The replica at the bench process's own priority: at its default nice +10 a busy,
    # shared machine's other processes would starve it and not the engine alone.
    child, key = start_tokenyard(
        None, auth=True, extra=["--batch-concurrency", str(args.batch_concurrency)],
        env_extra={"TOKENYARD_REPLICA_NICE": "0"})  # cli.processes.REPLICA_NICE_ENV
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
            server = Server(s, child.url, key)
            model = (await server.call("GET", "/v1/models"))["data"][0]["id"]
            await server.live(model, 2, 1, 2)  # warm-up
            rounds = []
            for r in range(args.rounds):
                rounds.append(x := await one_round(args, llm, server, model, r))
                print(f"round {r + 1}: engine alone {x.offline_tps:.1f} tok/s, batch "
                      f"{x.batch_tps:.1f} tok/s; live TTFT p50 {x.ttft_alone_ms:.0f} ms "
                      f"alone, {x.ttft_beside_ms:.0f} ms beside a batch; cancelled batch "
                      f"ended {x.cancel_s:.1f} s after its cancel; others' CPU % "
                      f"{x.others_pct}", file=sys.stderr, flush=True)
    finally:
        child.stop()
    return rounds, model


def _spread(values: list[float], fmt: str) -> str:
    return (f"{format(statistics.median(values), fmt)} | {format(min(values), fmt)} | "
            f"{format(max(values), fmt)}")


def render(rounds: list[Round], args: argparse.Namespace, command: str, model: str) -> str:
    ratio = [x.batch_tps / x.offline_tps for x in rounds]
    slow = [x.ttft_beside_ms / x.ttft_alone_ms for x in rounds]
    cancels = [x.cancel_s for x in rounds if x.cancel_s >= 0]
    rows = [
        "| figure | median | min | max | goal |", "|---|---|---|---|---|",
        f"| engine alone (`bench offline`'s throughput), output tok/s | "
        f"{_spread([x.offline_tps for x in rounds], '.1f')} | |",
        f"| batch alone, output tok/s | {_spread([x.batch_tps for x in rounds], '.1f')} | |",
        f"| batch / engine alone | {_spread(ratio, '.2f')} | >= 0.9 |",
        f"| live TTFT p50 ms, no batch | "
        f"{_spread([x.ttft_alone_ms for x in rounds], '.0f')} | |",
        f"| live TTFT p50 ms, beside the batch | "
        f"{_spread([x.ttft_beside_ms for x in rounds], '.0f')} | |",
        f"| live TTFT beside / alone | {_spread(slow, '.2f')} | <= 1.2 |",
        f"| a cancelled batch's end after its cancel, s | "
        f"{_spread(cancels, '.1f') if cancels else 'n/a | | '} | <= 5 |",
        "",
        "| round | engine alone tok/s | batch tok/s | ratio | TTFT p50 ms alone | beside "
        "| ratio | others' CPU % of the machine (offline, batch, live, live + batch) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, x in enumerate(rounds):
        others = ", ".join(f"{v:.0f}" for v in x.others_pct.values())
        rows.append(f"| {i + 1} | {x.offline_tps:.1f} | {x.batch_tps:.1f} | {ratio[i]:.2f} | "
                    f"{x.ttft_alone_ms:.0f} | {x.ttft_beside_ms:.0f} | {slow[i]:.2f} | "
                    f"{others} |")
    overlap = all(x.overlapped > 0 for x in rounds)
    return "\n".join([
        TITLE, "",
        f"`{model}` behind `tokenyard serve` (gateway on, the lane running "
        f"{args.batch_concurrency} lines at once, the replica at nice 0 like the bench) "
        f"against the same engine alone in the bench's process, given all of a round's "
        f"prompts at once (at most `max_num_seqs` running). Batches of "
        f"{args.lines} `/v1/completions` lines (random "
        f"token-id prompts of {args.min_prompt_len}-{args.max_prompt_len} tokens, greedy, "
        f"{args.output_len} out, ignore_eos), the engine alone on the same prompts; live: "
        f"{args.live_requests} streamed chat requests, {args.live_concurrency} at a time, "
        f"{args.live_output_len} out. {args.rounds} alternating rounds. "
        + ("The batch was still running when every live request beside it ended."
           if overlap else "In some rounds the batch ended before the live requests "
           "beside it: those rounds' TTFT beside it is partly without it."),
        "", f"- machine: {cpu_model()}, {os.cpu_count()} cores; 1-minute load average "
        f"{os.getloadavg()[0]:.2f} when written",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- command: `{command}`", "", *rows, ""])


def main(args: argparse.Namespace) -> int:
    if args.quick:
        for name, value in (("lines", 100), ("rounds", 2), ("live_requests", 8)):
            if getattr(args, name) == add_defaults()[name]:
                setattr(args, name, value)
    rounds, model = asyncio.run(run(args))
    command = "tokenyard " + " ".join(sys.argv[1:])
    report = render(rounds, args, command, model)
    print(report)
    if args.json:
        args.json.write_text(json.dumps([vars(x) for x in rounds], indent=2))
    if args.write:
        from tokenyard.bench.suite import replace_section

        page = args.write.read_text() if args.write.exists() else "# Benchmarks\n"
        args.write.write_text(replace_section(page, report))
    return 0


def add_defaults() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args([]))
