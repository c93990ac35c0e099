"""The agent's tool loop inside the gateway: model turn → MCP calls → results appended →
the next model turn, until the model answers without calling one (issue 41).

A `LoopRun` is the `Run` a dialect renders when its request offers MCP tools. Each model
turn (a hop) is a request of its own through `Pipeline.run`: routed, admitted under the
caller's key (limits, billing hold), moderated, generated and settled, with one ledger
row each (the first hop under the request's id, hop k under ``<id>-h<k>``).

Bounds: `max_calls` MCP calls (`DEFAULT_MAX_CALLS` unless the request sets its own) and
a wall-clock `deadline_s`; once either is reached, the next turn's grammar allows text
only. A forced tool choice binds every turn while calls remain when the request set its
own cap, else the first turn only. A turn that calls a client function or a tool that
waits for approval ends the loop. The HTTP request stays one request: one record (its
ticket sums the hops' usage and cost), one stream, and on its timeline a stage per hop
(``hop1``, ``mcp_call1``, ``hop2``, …) after ``mcp_list``.

The KV prefix is reused from hop to hop: hop k+1's prompt is hop k's prompt, then the
tokens hop k generated (its end-of-turn token dropped), then the results written as the
turn's continuation (``\\n<tool_response>…</tool_response>\\n``: what `text/tools.py`
renders for results that continue the assistant turn), so every full block of hop k is
a prefix hit for hop k+1 (same salt; the same replica by prefix affinity).

What the dialect renders, in order (`outputs`): each hop's outputs (a hop's last output
has its finish cleared unless it is the final one; every output carries the totals of
the hops so far), then at a hop boundary a `HopEnd`, then one `CallDone` per MCP call.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tokenyard.errors import APIError
from tokenyard.gateway.billing import Cost, Usage
from tokenyard.gateway.build_hooks import preparer
from tokenyard.gateway.call import Call, Generated, Prepared
from tokenyard.gateway.kinds import kind_of
from tokenyard.gateway.mcp_toolbox import Toolbox
from tokenyard.gateway.mcp_tools import ToolOutcome
from tokenyard.gateway.pipeline import Pipeline, Run
from tokenyard.gateway.served import Served
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.tool_calls import ParsedCall, split_tool_calls
from tokenyard.text.tool_grammar import markup_free
from tokenyard.text.tools import ToolChoice, ToolResult, renders_tools, results_text
from tokenyard.wire.outputs import Completion, RequestOutput
from tokenyard.wire.sampling_params import GuidedDecoding, SamplingParams

#: The longest a loop calls tools, in seconds; past it the next turn must answer in text.
DEADLINE_S = 120.0
#: The most MCP calls one response runs when its request sets no `max_tool_calls`.
DEFAULT_MAX_CALLS = 16


@dataclass(frozen=True)
class HopEnd:
    """Model turn `hop` (1, 2, …) ended in MCP calls the loop runs next."""

    hop: int
    finished: bool = False  # read like a RequestOutput's by the response writer
    deltas: tuple[Any, ...] = ()


@dataclass(frozen=True)
class CallDone:
    """The turn's MCP call `index` (in the order it was written) ran: its outcome."""

    index: int
    name: str
    arguments: str
    outcome: ToolOutcome
    finished: bool = False
    deltas: tuple[Any, ...] = ()


Step = HopEnd | CallDone


@dataclass
class Totals:
    """The hops' usage as one generation (what a dialect's usage figures read)."""

    params: SamplingParams
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    cache_writes: tuple[int, int] = (0, 0)
    finish_reasons: list[str | None] = field(default_factory=list)
    last: RequestOutput | None = None


def _cost_sum(a: Cost | None, b: Cost | None) -> Cost | None:
    if a is None or b is None:
        return a or b
    return Cost(a.micros + b.micros, {k: a.items.get(k, 0) + b.items.get(k, 0)
                                      for k in {*a.items, *b.items}})


def _usage_sum(a: Usage | None, b: Usage | None) -> Usage | None:
    if a is None or b is None:
        return a or b
    return Usage(a.prompt_tokens + b.prompt_tokens, a.cached_tokens + b.cached_tokens,
                 a.output_tokens + b.output_tokens,
                 a.cache_write_5m_tokens + b.cache_write_5m_tokens,
                 a.cache_write_1h_tokens + b.cache_write_1h_tokens)


class LoopRun(Run):
    """An MCP request's hops, rendered as one `Run` (see the module's docstring)."""

    def __init__(self, pipeline: Pipeline, call: Call, toolbox: Toolbox, *,
                 max_calls: int | None, output_cap: int | None,
                 deadline_s: float = DEADLINE_S) -> None:
        # Not Run.__init__: that starts one turn's generations; each hop is a Run of its own.
        self.pipeline, self.call, self.toolbox = pipeline, call, toolbox
        self.max_calls = DEFAULT_MAX_CALLS if max_calls is None else max_calls
        #: A forced choice (required, a named tool) binds every turn while calls remain
        #: when the request caps its calls; else only the first (as the openai-agents
        #: SDK resets it after a call), so that it cannot loop to the cap.
        self.reset_choice = max_calls is None
        self.output_cap = output_cap
        self.deadline = time.monotonic() + deadline_s
        self.hop: Run | None = None
        self.hops = 0
        self.calls_run = 0
        #: The running hop's generations (one list object, refilled per hop).
        self.gens = []
        #: What `outputs` yielded, in order: the format replays it for a non-streamed body.
        self.record: list[tuple[int, RequestOutput | Step]] = []
        self.capture = None
        self.ticket = None
        self._prior = (0, 0, 0)  # prompt, cached, output tokens of the hops before
        #: (prompt, cached, output) tokens of each hop that ended, in order.
        self.turns: list[tuple[int, int, int]] = []
        self._accounted: set[int] = set()
        self._hop_started = 0
        self._final = Completion(index=0)

    async def start(self) -> LoopRun:
        """Hop 1, on the request's own call (its refusals surface before any byte)."""
        first = replace(self.call, gens=[])
        self._hop_started = time.perf_counter_ns()
        run = await self.pipeline.run(first)
        self.call.route, self.call.served = first.route, first.served
        if first.ticket is not None:  # the request's ticket: the hops' sums (never settled)
            self.call.ticket = self.ticket = replace(
                first.ticket, finished=True, usage=None, status=None, cost=None, hold=None)
        self.served, self.ready, self.token_bytes = run.served, run.ready, run.token_bytes
        self.capture, run.capture = run.capture, None  # one capture: the whole response
        self._adopt(run)
        return self

    def _adopt(self, run: Run) -> None:
        self.hop = run
        self.hops += 1
        self.gens[:] = run.gens
        self.call.gens.extend(run.gens)

    # ------------------------------------------------------------------ the loop

    async def outputs(self) -> AsyncIterator[tuple[int, Any]]:
        while True:
            assert self.hop is not None
            completion = Completion(index=0)
            calls: list[ParsedCall] | None = None
            async for i, out in self.hop.outputs():
                for delta in out.deltas:
                    completion.add(delta)
                if out.finished:
                    calls = self._continues(completion)
                    if calls is not None:
                        out = replace(out, finished=False, deltas=[
                            replace(d, finish_reason=None, stop_reason=None)
                            for d in out.deltas])
                yield self._recorded(i, self._totalled(out))
            self._final = completion
            if calls is None:
                return
            await self._end_hop()
            yield self._recorded(0, HopEnd(self.hops))
            results = []
            started = time.perf_counter_ns()
            for index, call in enumerate(calls):
                outcome = await self._run(call)
                yield self._recorded(0, CallDone(index, call.name, call.arguments, outcome))
                results.append(ToolResult(outcome.text, call.name, outcome.is_error))
            self.call.timeline.add(f"mcp_call{self.hops}", time.perf_counter_ns() - started)
            await self._next_hop(completion, results)

    def _recorded(self, i: int, out: Any) -> tuple[int, Any]:
        self.record.append((i, out))
        return i, out

    def _continues(self, completion: Completion) -> list[ParsedCall] | None:
        """The MCP calls the loop runs after this turn, or None: the turn is the last (it
        answered, was cut, called a client function or a tool waiting for approval)."""
        if completion.finish_reason != "stop" or self.ready.tools is None:
            return None
        _, calls = split_tool_calls(completion.text, self.ready.tools, lambda: "")
        box = self.toolbox
        if not calls or any(box.server_of(c.name) is None or box.needs_approval(c.name)
                            for c in calls):
            return None
        return None if self._spent() else calls

    def _spent(self) -> bool:
        """Whether the loop may run no more calls (its budget or its time is up)."""
        return time.monotonic() > self.deadline or self.calls_run >= self.max_calls

    async def _run(self, call: ParsedCall) -> ToolOutcome:
        if self._spent():
            return ToolOutcome("Not run: this response reached its limit of tool calls.",
                               is_error=True, failure="max_tool_calls")
        self.calls_run += 1
        return await self.toolbox.call(call.name, call.arguments)

    def _totalled(self, out: RequestOutput) -> RequestOutput:
        p, c, o = self._prior
        return replace(out, num_prompt_tokens=p + out.num_prompt_tokens,
                       num_cached_tokens=c + out.num_cached_tokens,
                       num_output_tokens=o + out.num_output_tokens)

    async def _end_hop(self) -> None:
        """Close and settle the hop that just ended, and count it into the totals."""
        assert self.hop is not None
        await self.hop.close()
        self._account(self.hop)

    def _account(self, hop: Run) -> None:
        if id(hop) in self._accounted:
            return
        self._accounted.add(id(hop))
        self.call.timeline.add(f"hop{self.hops}", time.perf_counter_ns() - self._hop_started)
        turn = _turn(hop)
        self.turns.append(turn)
        self._prior = (self._prior[0] + turn[0], self._prior[1] + turn[1],
                       self._prior[2] + turn[2])
        total, ticket = self.ticket, hop.ticket
        if total is not None and ticket is not None:
            total.usage = _usage_sum(total.usage, ticket.usage)
            total.cost = _cost_sum(total.cost, ticket.cost)
            total.status = ticket.status

    async def _next_hop(self, completion: Completion, results: Sequence[ToolResult]) -> None:
        """Start the next turn: the last prompt, its reply and the results after it."""
        assert self.hop is not None and self.served.tokenizer is not None
        eos = set(self.served.tokenizer.eos_token_ids)
        generated = list(completion.token_ids)
        while generated and generated[-1] in eos:
            generated.pop()
        continuation = f"\n{results_text(results)}\n"
        prepare, _ = preparer(self.served)
        prompt = [*self.hop.ready.prompts[0], *generated,
                  *prepare.encode_rendered(continuation)]
        params = replace(self.ready.params[0], max_tokens=self.output_cap)
        tools = self.ready.tools
        if self._spent():  # the turn must answer: no more calls
            params = replace(params, guided=GuidedDecoding(
                "structural_tag", json.dumps(markup_free()), param="tools"))
        elif self.reset_choice and tools is not None and tools.choice.mode == "required":
            free = replace(tools, choice=ToolChoice("auto", None, tools.choice.parallel))
            params = prepare.constrained(replace(params, guided=None), free)
        served_name = self.served.name

        def build(served: Served, timeline: Timeline) -> Prepared:
            if served.name != served_name:
                raise APIError(503, "The deployment of this response's earlier turns is "
                               "not available for its next one; retry the request.")
            timeline.mark("templated")
            timeline.mark("tokenized")
            fitted = prepare.fit(len(prompt), params, self.call.param)
            return Prepared([prompt], [fitted], messages=[
                {"role": "user", "content": continuation}], tools=self.ready.tools)

        call = Call(endpoint=self.call.endpoint,
                    request_id=f"{self.call.request_id}-h{self.hops + 1}",
                    timeline=Timeline(lane=self.call.timeline.lane), model=self.call.model,
                    build=build,
                    key=self.call.key, capability=self.call.capability, param=self.call.param,
                    bounded=False, first_user_text=self.call.first_user_text,
                    batch=self.call.batch)
        self._hop_started = time.perf_counter_ns()
        run = await self.pipeline.run(call)
        run.capture = None
        self._adopt(run)

    def turn_usage(self) -> list[tuple[int, int, int]]:
        """(prompt, cached, output) tokens of every hop so far, the running one's too."""
        running = ([_turn(self.hop)] if self.hop is not None
                   and id(self.hop) not in self._accounted else [])
        return [*self.turns, *running]

    # ------------------------------------------------------------------ as a Run

    @property
    def generated(self) -> Sequence[Generated]:
        assert self.hop is not None
        gen = self.hop.gens[0]
        turns = self.turn_usage()
        p, c, o = (sum(t[i] for t in turns) for i in range(3))
        last = replace(gen.last, num_prompt_tokens=p, num_cached_tokens=c,
                       num_output_tokens=o) if gen.last is not None else None
        return [Totals(gen.params, p, c, o, gen.cache_writes, list(gen.finish_reasons),
                       last)]

    async def completions(self) -> list[list[Completion]]:
        """Every hop run to its end; the last hop's finished completion."""
        async for _ in self.outputs():
            pass
        return [[self._final]]

    def watch(self) -> None:
        """Nothing to collect: the format rebuilds the body from `record`."""

    def settle(self) -> None:
        if self.hop is not None:
            self.hop.settle()
            self._account(self.hop)

    async def close(self, *, given_up: bool = False) -> None:
        try:
            if self.hop is not None:
                await self.hop.close(given_up=given_up)
                self._account(self.hop)
        finally:
            await self.toolbox.close()
            if self.capture is not None:
                self.capture.send(None)



def require_loop(served: Served, param: str) -> None:
    """400 naming `param` unless `served` can run the loop: an engine deployment whose
    model writes calls in the ``<tool_call>`` form, whose turns the loop continues
    token by token (an upstream's or a native template's turns are not)."""
    native = served.tokenizer is not None and renders_tools(served.tokenizer.chat_template)
    if not kind_of(served.spec).model_facts or native or served.spec.tool_call_parser != "auto":
        raise APIError(400, f"MCP tools are not supported on the model `{served.name}`: the "
                       "platform runs them on engine deployments whose model writes calls "
                       "in the <tool_call> form (the embedded model does).", param=param)


def _turn(hop: Run) -> tuple[int, int, int]:
    """A hop's (prompt, cached, output) tokens."""
    gen = hop.gens[0]
    return (gen.num_prompt_tokens, gen.num_cached_tokens,
            gen.last.num_output_tokens if gen.last is not None else 0)
