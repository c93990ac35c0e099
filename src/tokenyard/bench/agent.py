"""`tokenyard bench agent`: hop overhead (issue 41, part 5): an agent task of 3 tool calls
run by the platform (the Responses `mcp` tool: the gateway calls the MCP server between
the model's turns) against the same task run by a client loop over HTTP (function tools;
the client calls the same MCP server itself and sends each result back with
`previous_response_id`).

One `tokenyard serve` of the embedded model and one MCP calculator on loopback
(`bench/mcp_server.py`), registered by the admin. Each round runs, in turn:

1. the first turn alone (the task's request with its calls waiting for approval, so the
   response ends after one turn): its prompt and cached tokens, what the task's first
   turn costs;
2. **platform**: the task, ``tool_choice: required``, one call a turn, ``max_tool_calls:
   3``: three MCP calls, then a turn that must answer in text;
3. **client**: the same four turns from the client, ``tool_choice: required`` for three
   turns and ``auto`` for the fourth.

Each run's user message starts with a fresh number (a task whose first turn was never
cached), of one length for all. Per run: wall time (the client's), the gateway process's
own CPU time (not the replica's), prompt tokens, cached tokens, and what was prefilled
again (prompt − cached); for the platform also the share of its later turns' prompts
served from the prefix cache, ``(cached − cached₁) / (prompt − prompt₁)`` with turn 1's
figures from step 1, and where its wall time went (its stages: model turns, MCP calls).
Medians over rounds. A small model on a busy 2-core machine: the wall figures are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenyard.bench.children import start_tokenyard
from tokenyard.bench.mcp_server import running_mcp_server
from tokenyard.bench.peers_table import write_section
from tokenyard.bench.proctree import sample_tree

TITLE = "## Agent hops: the platform's MCP loop against a client loop (`tokenyard bench agent`)"
TASK = "Task {n}: compute (2 + 3) * 4, then add 10. Use the tools, one step at a time."
TOOLS = ("add", "multiply")
TURN_TOKENS = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    parser.add_argument("--json", type=Path, help="write every run's figures as JSON here")
    parser.add_argument("--write", type=Path, help="replace this page's agent section")


@dataclass
class Run:
    mode: str
    wall_s: float
    gateway_cpu_s: float
    prompt_tokens: int
    cached_tokens: int
    calls: int
    stages_ms: dict[str, float] = field(default_factory=dict)
    later_cached_share: float | None = None

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class Bench:
    def __init__(self, base: str, key: str, gateway_pid: int, mcp_url: str, model: str):
        self.base, self.key, self.pid, self.mcp_url, self.model = (
            base, key, gateway_pid, mcp_url, model)
        self.http = httpx.AsyncClient(base_url=base, timeout=900,
                                      headers={"Authorization": f"Bearer {key}"})

    async def post(self, body: dict[str, Any]) -> dict[str, Any]:
        r = await self.http.post("/v1/responses", json={"model": self.model,
                                                        "temperature": 0} | body)
        r.raise_for_status()
        return dict(r.json())

    def task(self, n: int, **fields: Any) -> dict[str, Any]:
        tool = {"type": "mcp", "server_label": "calc", "require_approval": "never",
                "allowed_tools": list(TOOLS)}
        return {"input": TASK.format(n=n), "tools": [tool], "tool_choice": "required",
                "max_tool_calls": 3, "parallel_tool_calls": False,
                "max_output_tokens": TURN_TOKENS} | fields

    async def first_turn(self, n: int) -> tuple[int, int]:
        task = self.task(n)
        task["tools"][0]["require_approval"] = "always"
        usage = (await self.post(task))["usage"]
        return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]

    async def platform(self, n: int, first: tuple[int, int]) -> Run:
        start, cpu = time.perf_counter(), sample_tree(self.pid).root_cpu_s
        body = await self.post(self.task(n))
        wall, cpu = time.perf_counter() - start, sample_tree(self.pid).root_cpu_s - cpu
        usage = body["usage"]
        prompt, cached = usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
        later = prompt - first[0]
        return Run("platform", wall, cpu, prompt, cached,
                   sum(1 for i in body["output"] if i["type"] == "mcp_call"),
                   body.get("timings", {}),
                   (cached - first[1]) / later if later > 0 else None)

    async def client(self, n: int, tools: list[dict[str, Any]], session: Any) -> Run:
        start, cpu = time.perf_counter(), sample_tree(self.pid).root_cpu_s
        prompt = cached = calls = 0
        body = await self.post({"input": TASK.format(n=n), "tools": tools,
                                "tool_choice": "required", "parallel_tool_calls": False,
                                "max_output_tokens": TURN_TOKENS})
        for turn in range(4):
            usage = body["usage"]
            prompt += usage["input_tokens"]
            cached += usage["input_tokens_details"]["cached_tokens"]
            made = [i for i in body["output"] if i["type"] == "function_call"]
            if not made or turn == 3:
                break
            results = []
            for item in made:
                calls += 1
                outcome = await session.call_tool(item["name"], json.loads(item["arguments"]))
                results.append({"type": "function_call_output", "call_id": item["call_id"],
                                "output": outcome.text})
            body = await self.post({"previous_response_id": body["id"], "input": results,
                                    "tools": tools, "parallel_tool_calls": False,
                                    "tool_choice": "required" if turn < 2 else "auto",
                                    "max_output_tokens": TURN_TOKENS})
        wall, cpu = time.perf_counter() - start, sample_tree(self.pid).root_cpu_s - cpu
        return Run("client", wall, cpu, prompt, cached, calls)


async def _rounds(bench: Bench, rounds: int) -> list[Run]:
    from tokenyard.api.mcp_client import McpClient
    from tokenyard.gateway.mcp_tools import McpServer

    session = await McpClient().open(McpServer("calc", bench.mcp_url, registered=True))
    try:
        listed = {t.name: t for t in await session.list_tools()}
        tools = [{"type": "function", "name": name, "description": listed[name].description,
                  "parameters": listed[name].input_schema} for name in TOOLS]
        rng = random.Random(41)
        runs: list[Run] = []
        await bench.platform(rng.randrange(1000, 10000), (0, 0))  # warm-up: kernels, lists
        for _ in range(rounds):
            first = await bench.first_turn(rng.randrange(1000, 10000))
            runs.append(await bench.platform(rng.randrange(1000, 10000), first))
            runs.append(await bench.client(rng.randrange(1000, 10000), tools, session))
        return runs
    finally:
        await session.close()
        await bench.http.aclose()


def _median(runs: list[Run], value: Any) -> float:
    return statistics.median(value(r) for r in runs)


def render(runs: list[Run]) -> str:
    """The page's section: the two modes side by side (medians), then where the
    platform's wall time went."""
    by = {mode: [r for r in runs if r.mode == mode] for mode in ("platform", "client")}
    rows = [("wall time (s)", lambda r: r.wall_s, "{:.1f}"),
            ("gateway CPU (ms)", lambda r: r.gateway_cpu_s * 1000, "{:.0f}"),
            ("MCP calls", lambda r: r.calls, "{:.0f}"),
            ("prompt tokens (all turns)", lambda r: r.prompt_tokens, "{:.0f}"),
            ("cached tokens", lambda r: r.cached_tokens, "{:.0f}"),
            ("prefilled again (prompt − cached)", lambda r: r.prefilled, "{:.0f}")]
    lines = [TITLE, "", __doc__.split("\n\n", 1)[0].split(":", 1)[1].strip(), "",
             f"Medians of {len(by['platform'])} rounds (`tokenyard bench agent`).", "",
             "| | platform (MCP) | client loop | client / platform |", "|---|---|---|---|"]
    for name, value, fmt in rows:
        p, c = _median(by["platform"], value), _median(by["client"], value)
        ratio = f"{c / p:.2f}×" if p else "–"
        lines.append(f"| {name} | {fmt.format(p)} | {fmt.format(c)} | {ratio} |")
    shares = [r.later_cached_share for r in by["platform"] if r.later_cached_share is not None]
    if shares:
        lines += ["", "Platform: the later turns' prompts served from the prefix cache: "
                  + ", ".join(f"{s:.0%}" for s in shares) + " (per round)."]
    stages = by["platform"][-1].stages_ms
    hops = sum(v for k, v in stages.items() if k.startswith("hop"))
    mcp = sum(v for k, v in stages.items() if k.startswith("mcp_"))
    wall = by["platform"][-1].wall_s * 1000
    lines += ["", f"Where the platform's last run went: model turns {hops:.0f} ms "
              f"({hops / wall:.0%} of its wall time), MCP list and calls {mcp:.0f} ms, "
              f"the rest {wall - hops - mcp:.0f} ms (HTTP, parsing, the loop).", ""]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    with running_mcp_server() as mcp_url:
        child, key = start_tokenyard(None)
        try:
            assert key is not None
            base = child.url
            admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"})
            org = next(o["id"] for o in admin.get("/admin/v1/orgs").json()["data"]
                       if o["name"] == "default")
            made = admin.post(f"/admin/v1/orgs/{org}/mcp_servers",
                              json={"label": "calc", "url": mcp_url})
            made.raise_for_status()
            model = admin.get("/v1/models").json()["data"][0]["id"]
            runs = asyncio.run(_rounds(Bench(base, key, child.pid, mcp_url, model),
                                       args.rounds))
        finally:
            child.stop()
    section = render(runs)
    print(section)
    if args.json is not None:
        args.json.write_text(json.dumps([r.__dict__ for r in runs], indent=2))
    if args.write is not None:
        write_section(args.write, section, TITLE)
    return 0
