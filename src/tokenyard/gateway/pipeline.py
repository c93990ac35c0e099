"""The request pipeline's one owner: `Pipeline.run` takes a request already converted from
its dialect and drives DESIGN §1's stages in order, for an HTTP route and for a caller
without HTTP (a batch worker) alike:

    route (9) → authorize the model (4) → cheap bounds → prepare (10: template and
    tokenize, off the event loop when large) → authorize the context, limit, billing
    hold (4–6) → the expensive work (images) → moderate input (8) → capture → generate
    on the balancer (12), shadow copy, moderate output (17) → … → settle (19)

Nothing that costs more than a few hundred microseconds or a few kilobytes runs before
the key may use the model, and nothing beyond bounded tokenization runs before the key is
admitted by its limits and its balance: a text too long for the model's window in bytes
is refused before it is tokenized; images are fetched and decoded only once admitted.

What stays in the dialect (`api/`): parsing, the conversion into template messages and
sampling parameters, the dialect's own prompt work that needs the chosen deployment (its
`build` hook: tool messages, the template, its prefill rule, cache pins), and rendering
what `Run` yields in the dialect's shape. The caller gets a `Run`: the started
generations, their outputs, `settle` (what the ledger row charges, once) and `close`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from tokenyard.balancer.generation import Generation, finished_completions, merged
from tokenyard.errors import invalid_request
from tokenyard.gateway.auth import KeyContext, authorize
from tokenyard.gateway.billing import Cost
from tokenyard.gateway.build_hooks import (
    ToolPlacement,
    first_user_text,
    placed,
    prepared,
    text_size,
)
from tokenyard.gateway.capture import BodyCapture
from tokenyard.gateway.gate import Ticket
from tokenyard.gateway.moderate import check_input, policy_for, tap
from tokenyard.gateway.moderation import Moderator, Policy
from tokenyard.gateway.routing import Route, conversation_key, require
from tokenyard.gateway.served import Fleet, Served
from tokenyard.gateway.shadow_copies import Shadows
from tokenyard.telemetry.metrics import TokenyardMetrics
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.content import TemplateMessage, image_parts, require_vision
from tokenyard.text.tools import ToolUse
from tokenyard.wire.outputs import Completion, RequestOutput
from tokenyard.wire.protocol import Pin
from tokenyard.wire.sampling_params import SamplingParams

logger = logging.getLogger("tokenyard.gateway")

_T = TypeVar("_T")

#: Inputs past this many bytes of text are templated and tokenized on a worker thread,
#: so a long prompt does not hold the event loop (and every other request) meanwhile.
OFF_LOOP_BYTES = 16 * 1024


class Generated(Protocol):
    """What a dialect's renderer reads of one generation (the balancer's `Generation`)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_cached_tokens(self) -> int: ...

    @property
    def last(self) -> RequestOutput | None: ...

    @property
    def cache_writes(self) -> tuple[int, int]: ...

    @property
    def finish_reasons(self) -> list[str | None]: ...


class LoadsImages(Protocol):
    """The image stage (fetch, decode, re-encode), given to the pipeline by its builder."""

    def __call__(self, messages: Sequence[TemplateMessage], *, model: str,
                 vision: bool) -> Awaitable[list[TemplateMessage]]: ...


@dataclass
class Prepared:
    """What a dialect's `build` makes of its request for the chosen deployment."""

    #: One prompt's token ids per sequence group, and each one's fitted parameters.
    prompts: list[list[int]]
    params: list[SamplingParams]
    #: The chat messages (an upstream's body, moderation's input, the images to load).
    messages: list[TemplateMessage] | None = None
    #: The prompt texts (a completions request to an upstream), None where token ids.
    texts: list[str | None] | None = None
    #: Prompt prefixes the replica keeps cached (Anthropic's cache_control).
    pins: Sequence[Pin] = ()
    #: Tools an upstream gets in its body (an engine sees them in its prompt).
    passed_on: ToolUse | None = None
    #: The request's tools as its reply is parsed for calls (wherever they went).
    tools: ToolUse | None = None
    #: Whatever else the dialect's build hands its renderer (completions' echo texts).
    note: Any = None


#: A dialect's prompt work for one deployment: tool messages, template, tokenize, fit. It
#: may run on a worker thread (a large input), so it touches nothing but its arguments.
Build = Callable[[Served, Timeline], Prepared]


@dataclass(eq=False)
class Call:
    """One request, converted from its dialect, on its way through the pipeline."""

    endpoint: str
    request_id: str
    timeline: Timeline
    #: The model name the client asked for (a deployment or an alias).
    model: str
    build: Build
    #: The authenticated key (None: served without a gateway).
    key: KeyContext | None = None
    capability: str = "chat"
    #: The longest single input's text, in characters (at most its UTF-8 bytes): bounded
    #: against the window before anything is tokenized. `param` names it in a refusal;
    #: `bounded=False` for a request that truncates its input to fit (the Responses
    #: API's "auto").
    text_size: int = 0
    param: str = "messages"
    bounded: bool = True
    #: The first user message's text: what a conversation's canary draw sticks to.
    first_user_text: str | None = None
    #: The body as received, for an org that captures bodies.
    raw: bytes | None = None
    #: The batch this call is a line of (None: a live request): it runs at the batch
    #: priority, priced at the batch price, its ledger row tagged with the batch.
    batch: str | None = None
    # Filled in as the request goes, for the caller's summary and headers, whether or
    # not it got through:
    route: Route | None = None
    served: Served | None = None
    ticket: Ticket | None = None
    gens: list[Generation] = field(default_factory=list)


class Pipeline:
    """DESIGN §1's stages over one fleet, in order; see the module's docstring."""

    def __init__(self, fleet: Fleet, *, images: LoadsImages | None = None) -> None:
        self.fleet = fleet
        self.images = images
        #: Set when the application starts (its classifiers load then); None: no
        #: moderation at all.
        self.moderator: Moderator | None = None
        self.shadows = Shadows(fleet)

    def start(self) -> None:
        self.shadows.start()

    async def close(self) -> None:
        await self.shadows.close()

    # ------------------------------------------------------------------ the stages

    def route(self, call: Call) -> Served:
        """Stage 9 and the model half of stage 4: the deployment that serves `call` (404
        for an unknown name; 400 if it lacks the capability; 403 outside the key's
        regions), which the key must be allowed to use (403) before any work is done
        for it."""
        fleet = self.fleet
        key = call.key
        router = fleet.router
        # The conversation's point only picks among an alias's routes: no hash for a
        # deployment named directly (most requests).
        point = (0.0 if call.model in router.fleet.deployments
                 else conversation_key(call.first_user_text))
        chosen = router.resolve(call.model, point,
                                key.allowed_regions if key is not None else None)
        served = fleet.deployments[chosen.deployment]
        require(served.spec, call.capability)
        call.route, call.served = chosen, served
        if fleet.gateway is not None and call.key is not None:
            authorize(call.key, served.name, 0, alias=chosen.alias)
        return served

    async def prepare(self, call: Call, served: Served) -> Prepared:
        """Stage 10 under its cheap bound: a text that cannot fit the window whatever the
        tokenizer makes of it (more bytes than the window's tokens can spell) is refused
        untokenized; a large one is templated and tokenized on a worker thread."""
        if call.bounded and served.tokenizer is not None:
            window = served.window
            at_least = -(-call.text_size // served.max_token_bytes)
            if at_least > window:
                raise invalid_request(
                    f"This model's context window is {window} tokens, but the input has "
                    f"{call.text_size} characters of text: at least {at_least} tokens. "
                    "Shorten the input.", param=call.param, code="context_length_exceeded")
        if max(call.text_size, len(call.raw or b"")) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(call.build, served, call.timeline)
        return call.build(served, call.timeline)

    async def admit(self, call: Call, served: Served, ready: Prepared) -> Ticket | None:
        """Stages 4–6: the key's context scope, its limits (reserving every prompt token
        and every token the completions may generate) and its billing hold. None without
        a gateway."""
        gateway = self.fleet.gateway
        if gateway is None or call.key is None:
            return None
        assert call.route is not None
        call.ticket = await gateway.admit_prompts(
            call.key, model=served.name, endpoint=call.endpoint, request_id=call.request_id,
            prompts=ready.prompts, params=ready.params, timeline=call.timeline,
            alias=call.route.alias, region=call.route.region, batch=call.batch,
            own_batch_prices=served.spec.batch_prices,
        )
        return call.ticket

    async def run(self, call: Call) -> Run:
        """Every stage up to a started generation (refusals surface here, before any
        byte of the answer): the caller renders what the `Run` yields, then closes it."""
        served = self.route(call)
        ready = await self.prepare(call, served)
        if ready.messages is not None:  # cheap: a 400 before admission, not after it
            require_vision(ready.messages, served.name, served.vision)
        ticket = await self.admit(call, served, ready)
        try:
            policy = await self._expensive(call, served, ready)
        except BaseException:
            self._settle(ticket, [])
            raise
        run = Run(self, call, served, ready, ticket, policy)
        try:
            # Sent together: the replica batches them; a refusal of any refuses the request.
            await _each(run.gens, lambda gen: gen.start())
        except BaseException:
            await run.close()
            raise
        return run

    async def count(self, call: Call) -> int:
        """Anthropic's count_tokens: the prompt's length, for a key that may use the model
        and is within its request limits (it reserves no tokens and is not billed)."""
        served = self.route(call)
        ready = await self.prepare(call, served)
        if ready.messages is not None:
            require_vision(ready.messages, served.name, served.vision)
        gateway = self.fleet.gateway
        if gateway is not None and call.key is not None:
            ticket = await gateway.admit(
                call.key, model=served.name, endpoint=call.endpoint,
                request_id=call.request_id, prompt_tokens=0, max_tokens=0,
                timeline=call.timeline, alias=call.route.alias if call.route else None,
                region=call.route.region if call.route else None)
            gateway.finish(ticket, None, "completed")
        return len(ready.prompts[0])

    async def _expensive(self, call: Call, served: Served, ready: Prepared) -> Policy:
        """What an admitted request may cost: its images loaded, its input moderated;
        returns its moderation policy, which its output goes through too."""
        if ready.messages is not None and image_parts(ready.messages):
            if self.images is None:
                raise invalid_request("This server does not take image input.",
                                      param=call.param)
            ready.messages = await self.images(ready.messages, model=served.name,
                                               vision=served.vision)
        key = call.key
        policy = await policy_for(
            self.moderator, served, key.org_id if key is not None else None)
        await check_input(self.moderator, policy, served, ready.prompts,
                          messages=ready.messages, texts=ready.texts,
                          request_id=call.request_id, timeline=call.timeline)
        return policy

    def _settle(self, ticket: Ticket | None, gens: Sequence[Generation]) -> None:
        gateway = self.fleet.gateway
        if gateway is not None and ticket is not None:
            gateway.settle(ticket, gens)


class Run:
    """An admitted request's generations, started: what the caller renders, and the one
    place it is settled."""

    def __init__(self, pipeline: Pipeline, call: Call, served: Served, ready: Prepared,
                 ticket: Ticket | None, policy: Policy) -> None:
        self.pipeline, self.call, self.served, self.ready = pipeline, call, served, ready
        self.ticket = ticket
        gateway, key = pipeline.fleet.gateway, call.key
        self.capture = (BodyCapture(gateway.requests, call.request_id, key, call.raw or b"")
                        if gateway is not None and key is not None
                        and gateway.requests.capturing(key) else None)
        self.token_bytes: Callable[[int], bytes]
        table = None
        if served.kind == "upstream":
            from tokenyard.balancer.upstream_generation import TokenTable

            self.token_bytes = table = TokenTable()
        else:
            assert served.tokenizer is not None
            self.token_bytes = served.tokenizer.id_to_token_bytes
        base = call.request_id
        many = len(ready.prompts) > 1
        gens = call.gens = [
            _generation(served, f"{base}-{i}" if many else base, p, fp, call, ready,
                        ready.texts[i] if ready.texts else None, table,
                        pipeline.fleet.metrics)
            for i, (p, fp) in enumerate(zip(ready.prompts, ready.params, strict=True))
        ]
        # Shadow traffic: the copy starts now, in the background (untouched without one).
        assert call.route is not None
        gens = pipeline.shadows.tap(
            call.route, served, gens, base, ready.prompts, ready.params,
            messages=ready.messages, texts=ready.texts,
            cache_salt=ticket.cache_salt if ticket is not None else None)
        # Output moderation: held back and checked.
        self.gens: list[Generation] = tap(pipeline.moderator, policy, gens, base,
                                          call.timeline)
        self._settled = False

    @property
    def generated(self) -> Sequence[Generated]:
        return cast(Sequence[Generated], self.gens)

    @property
    def cost(self) -> Cost | None:
        """What the ledger row charges, once settled (None: not metered)."""
        return self.ticket.cost if self.ticket is not None else None

    async def completions(self) -> list[list[Completion]]:
        """Every generation run to its end: each prompt's finished choices."""
        return await _each(self.gens, finished_completions)

    def watch(self) -> None:
        """A streamed request: its captured body is built from the outputs as they go."""
        if self.capture is not None:
            self.capture.watch(self.gens)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every generation's outputs as they arrive, tagged with its position."""
        outs = (_single(self.gens[0]) if len(self.gens) == 1 else merged(self.gens))
        async for i, out in outs:
            if self.capture is not None:
                self.capture.add(i, out)
            yield i, out

    def settle(self) -> None:
        """Settle the ticket with what the generations really used, once (the body or
        the last event carries the cost the ledger row charges)."""
        if not self._settled:
            self._settled = True
            self.pipeline._settle(self.ticket, self.gens)

    def captured(self, body: Any) -> None:
        """The response body the client got (or, for a stream, would have got)."""
        if self.capture is not None:
            self.capture.send(body)

    async def close(self) -> None:
        """Close every generation (the replica aborts what is unfinished), settle, and
        capture the request alone if no response was."""
        for gen in self.gens:
            await gen.close()
        self.settle()
        if self.capture is not None:
            self.capture.send(None)


async def _single(gen: Generation) -> AsyncIterator[tuple[int, RequestOutput]]:
    async for out in gen:
        yield 0, out


async def _each(
    gens: Sequence[Generation], fn: Callable[[Generation], Awaitable[_T]]
) -> list[_T]:
    """`fn(gen)` for every generation, concurrently (no task for a lone one)."""
    if len(gens) == 1:
        return [await fn(gens[0])]
    return list(await asyncio.gather(*(fn(gen) for gen in gens)))


def _generation(
    served: Served, request_id: str, prompt: list[int], params: SamplingParams, call: Call,
    ready: Prepared, text: str | None, table: Any, metrics: TokenyardMetrics,
) -> Generation:
    """A generation on the deployment's pool for an admitted request, salted and
    prioritised as its ticket says (without a gateway: one tenant, no salt, normal
    priority)."""
    ticket = call.ticket
    salt = ticket.cache_salt if ticket is not None else None
    priority = ticket.priority if ticket is not None else 0
    if served.kind == "upstream":
        from tokenyard.balancer.upstream_generation import UpstreamGeneration

        return cast(Generation, UpstreamGeneration(
            served.pool, request_id, messages=ready.messages, prompt=text, params=params,
            model=served.spec.model or served.name, timeline=call.timeline,
            metrics=metrics, prompt_tokens_estimate=len(prompt), tokens=table,
            tools=ready.passed_on, cache_salt=salt,
        ))
    assert served.tokenizer is not None
    return Generation(
        served.pool, served.tokenizer, request_id, prompt, params,
        timeline=call.timeline, metrics=metrics, cache_salt=salt, priority=priority,
        pins=ready.pins,
    )


__all__ = ["Build", "Call", "Generated", "LoadsImages", "Pipeline", "Prepared", "Run",
           "Served", "ToolPlacement", "first_user_text", "placed", "prepared", "text_size"]
