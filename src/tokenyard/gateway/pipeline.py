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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from tokenyard.errors import invalid_request
from tokenyard.gateway.auth import authorize
from tokenyard.gateway.billing import Cost
from tokenyard.gateway.build_hooks import (
    ToolPlacement,
    first_user_text,
    placed,
    preparer,
    text_size,
)
from tokenyard.gateway.call import (
    DONE,
    FLUSH,
    Call,
    Event,
    Failed,
    Finish,
    Generated,
    Generating,
    Mark,
    Prepared,
    Render,
    outcome,
)
from tokenyard.gateway.capture import BodyCapture
from tokenyard.gateway.fallbacks import run_with_fallbacks
from tokenyard.gateway.gate import Ticket
from tokenyard.gateway.generations import each, finished_completions, merged, single
from tokenyard.gateway.kinds import Opening, kind_of
from tokenyard.gateway.moderate import check_input, policy_for, tap
from tokenyard.gateway.moderation import ModerationPolicy, Moderator
from tokenyard.gateway.routing import conversation_key, require
from tokenyard.gateway.served import Fleet, Served
from tokenyard.gateway.shadow_copies import Shadows
from tokenyard.text.content import TemplateMessage, image_parts, require_vision
from tokenyard.wire.outputs import Completion, RequestOutput

logger = logging.getLogger("tokenyard.gateway")

_T = TypeVar("_T")

#: Inputs past this many bytes of text are templated and tokenized on a worker thread,
#: so a long prompt does not hold the event loop (and every other request) meanwhile.
OFF_LOOP_BYTES = 16 * 1024


class LoadsImages(Protocol):
    """The image stage (fetch, decode, re-encode), given to the pipeline by its builder."""

    def __call__(self, messages: Sequence[TemplateMessage], *, model: str,
                 vision: bool) -> Awaitable[list[TemplateMessage]]: ...


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
        and every token the completions may generate) and its billing hold; one request
        from the RPM buckets unless the call took it already (`Call.counted`). None
        without a gateway."""
        gateway = self.fleet.gateway
        if gateway is None or call.key is None:
            return None
        assert call.route is not None
        call.ticket = await gateway.admit_prompts(
            call.key, model=served.name, endpoint=call.endpoint, request_id=call.request_id,
            prompts=ready.prompts, params=ready.params, timeline=call.timeline,
            alias=call.route.alias, region=call.route.region, batch=call.batch,
            own_batch_prices=served.spec.batch_prices, counted=call.counted,
        )
        call.counted = True  # a fallback's attempt after this one is the same request
        return call.ticket

    async def run(self, call: Call) -> Run:
        """Every stage up to a started generation (refusals surface here, before any
        byte of the answer): the caller renders what the `Run` yields, then closes it.
        A request that fails before its first byte goes on to its fallbacks, if any."""
        return await run_with_fallbacks(self, call)

    async def serve(self, call: Call, served: Served, *,
                    first_byte_timeout_s: float | None = None,
                    moves_on: Callable[[BaseException], bool] | None = None,
                    queues: bool = True) -> Run:
        """`run` past routing, on `served`: prepare, admit, the expensive work, then
        start the generations — within `first_byte_timeout_s` (None: unbounded; past it,
        TimeoutError). A start that fails so that the request `moves_on` to a fallback
        is given up: closed unbilled and uncaptured (the next attempt captures it).
        `queues=False`: an upstream's 429 ends the attempt at once (its fallback takes
        rate limits) instead of waiting in the pool's queue."""
        ready = await self.prepare(call, served)
        if ready.messages is not None:  # cheap: a 400 before admission, not after it
            require_vision(ready.messages, served.name, served.vision)
        ticket = await self.admit(call, served, ready)
        try:
            policy = await self._expensive(call, served, ready)
        except BaseException:
            self._settle(ticket, [])
            raise
        run = Run(self, call, served, ready, ticket, policy, queues=queues)
        try:
            # Sent together: the replica batches them; a refusal of any refuses the request.
            async with asyncio.timeout(first_byte_timeout_s):
                await each(run.gens, lambda gen: gen.start())
        except BaseException as exc:
            await run.close(given_up=moves_on is not None and moves_on(exc))
            raise
        return run

    async def count(self, call: Call) -> int:
        """Anthropic's count_tokens: the prompt's length, for a key that may use the model
        and is within its request limits (it reserves no tokens and is not billed)."""
        served = self.route(call)
        ready = await self.prepare(call, served)
        if ready.messages is not None:
            require_vision(ready.messages, served.name, served.vision)
        self.release(await self.admit_request(call))
        return len(ready.prompts[0])

    async def admit_request(self, call: Call) -> Ticket | None:
        """The key admitted for routed `call` as a request, before its prompt exists:
        its model scope, one request from its RPM, a concurrency slot and the money
        pre-check (each refusing with its 429), no tokens held. For work a dialect does
        before the prompt that costs the platform (an MCP loop contacts its servers):
        the call is `counted`, so its first attempt takes no second request; `release`
        the ticket before that attempt is admitted. None without a gateway."""
        gateway = self.fleet.gateway
        if gateway is None or call.key is None:
            return None
        assert call.served is not None
        ticket = await gateway.admit(
            call.key, model=call.served.name, endpoint=call.endpoint,
            request_id=call.request_id, prompt_tokens=0, max_tokens=0,
            timeline=call.timeline, alias=call.route.alias if call.route else None,
            region=call.route.region if call.route else None, batch=call.batch)
        call.counted = True
        return ticket

    def release(self, ticket: Ticket | None) -> None:
        """Give back a ticket nothing ran under (its slot; no ledger row). Idempotent."""
        self._settle(ticket, [])

    async def _expensive(self, call: Call, served: Served, ready: Prepared) -> ModerationPolicy:
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

    def _settle(self, ticket: Ticket | None, gens: Sequence[Generating]) -> None:
        gateway = self.fleet.gateway
        if gateway is not None and ticket is not None:
            gateway.finish(ticket, *outcome(gens))


class Run:
    """An admitted request's generations, started: what the caller renders, and the one
    place it is settled."""

    def __init__(self, pipeline: Pipeline, call: Call, served: Served, ready: Prepared,
                 ticket: Ticket | None, policy: ModerationPolicy, *,
                 queues: bool = True) -> None:
        self.pipeline, self.call, self.served, self.ready = pipeline, call, served, ready
        self.ticket = ticket
        gateway, key = pipeline.fleet.gateway, call.key
        self.capture = (BodyCapture(gateway.requests, call.request_id, key, call.raw or b"")
                        if gateway is not None and key is not None
                        and gateway.requests.capturing(key) else None)
        ticket_salt = ticket.cache_salt if ticket is not None else None
        base = call.request_id
        many = len(ready.prompts) > 1
        opened = kind_of(served.spec).open(served, [
            Opening(f"{base}-{i}" if many else base, prompt, params, messages=ready.messages,
                    text=ready.texts[i] if ready.texts else None, pins=ready.pins,
                    tools=ready.passed_on, cache_salt=ticket_salt,
                    priority=ticket.priority if ticket is not None else 0,
                    timeline=call.timeline, metrics=pipeline.fleet.metrics, queues=queues)
            for i, (prompt, params) in enumerate(zip(ready.prompts, ready.params,
                                                     strict=True))])
        #: Spells the ids of the outputs' logprobs (what the dialect's format is given).
        self.token_bytes = opened.token_bytes
        gens = call.gens = opened.gens
        # Shadow traffic: the copy starts now, in the background (untouched without one).
        assert call.route is not None
        gens = pipeline.shadows.tap(
            call.route, served, gens, base, ready.prompts, ready.params,
            messages=ready.messages, texts=ready.texts,
            cache_salt=ticket_salt)
        # Output moderation: held back and checked.
        self.gens: list[Generating] = tap(pipeline.moderator, policy, gens, base,
                                          call.timeline)
        self._settled = False

    @property
    def cost(self) -> Cost | None:
        """What the ledger row charges, once settled (None: not metered)."""
        return self.ticket.cost if self.ticket is not None else None

    async def completions(self) -> list[list[Completion]]:
        """Every generation run to its end: each prompt's finished choices."""
        return await each(self.gens, finished_completions)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every generation's outputs as they arrive, tagged with its position."""
        outs = (single(self.gens[0]) if len(self.gens) == 1 else merged(self.gens))
        async for i, out in outs:
            if self.capture is not None:
                self.capture.add(i, out)
            yield i, out

    @property
    def generated(self) -> Sequence[Generated]:
        """What the answer renders: the generations (an MCP loop's: every hop's sums)."""
        return self.gens

    def settle(self) -> None:
        """Settle the ticket with what the generations really used, once (the body or
        the last event carries the cost the ledger row charges)."""
        if not self._settled:
            self._settled = True
            self.pipeline._settle(self.ticket, self.gens)

    def stamp(self, event: Event) -> dict[str, Any]:
        """A response's last event (or its whole body) as JSON with the request's stage
        durations (ms) as `timings` — the Server-Timing figures the header could not
        hold, since a stream's went out before decoding — and, once metered, its `cost`:
        the ledger row's charge with its line items, as decimal strings."""
        body = event.model_dump(mode="json")
        body["timings"] = self.call.timeline.timings_ms()
        if self.cost is not None:
            body["cost"] = self.cost.to_json()
        return body

    async def complete(self, render: Render, finish: Finish | None = None) -> dict[str, Any]:
        """A non-streamed answer: every generation run to its end, settled, its body in
        `render`'s shape (`stamp`ed: it carries the cost the ledger row charges), then the
        request's `end` (the caller writes the body). Closed whatever happens."""
        try:
            completions = await self.completions()
            self.settle()
            body = self.stamp(render.body(self.generated, completions))
            await self.end(finish, body)
            return body
        finally:
            await self.close()

    async def stream(self, render: Render, finish: Finish | None = None,
                     ) -> AsyncGenerator[Event | dict[str, Any] | Mark, None]:
        """A streamed answer, in order: a first `FLUSH` (the headers may go out), then
        `render`'s events, `FLUSH` where what came so far may go out in one write (no next
        output is in yet: events of one replica step leave together), a `Failed` for a
        failure after the first byte; the last event (`stamp`ed) and `DONE` come after
        the request's `end`, so a stream the client saw complete is settled and its cost
        is the ledger row's. Closed whatever happens: iterate it under
        `contextlib.aclosing`."""
        if self.capture is not None:  # its body is built from the outputs as they go
            self.capture.watch(self.gens)
        try:
            yield FLUSH  # nothing yet: the headers go out before the first output is read
            for event in render.head():
                yield event
            last: list[Event] = []
            failure: Exception | None = None
            body: dict[str, Any] | None = None
            unfinished = len(self.gens)
            try:
                async for i, out in self.outputs():
                    events = render.events(i, out)
                    unfinished -= out.finished
                    if not unfinished:
                        last.extend(events)  # held: the very last event has the timings
                        continue
                    for event in events:
                        yield event
                    if not any(gen.backlog for gen in self.gens):
                        yield FLUSH
            except (ConnectionResetError, asyncio.CancelledError):
                raise  # the client is gone: nothing to tell it
            except Exception as exc:
                failure = exc
            else:
                last.extend(render.tail(self.generated))
                self.settle()  # metered before the last byte
                if self.capture is not None:
                    body = self.stamp(render.body(self.generated,
                                                  self.capture.completions))
            await self.end(finish, body)
            if failure is not None:
                yield Failed(failure)
            else:
                for event in last[:-1]:
                    yield event
                if last:
                    yield self.stamp(last[-1])
                yield DONE
            yield FLUSH
        finally:
            await self.close()

    async def end(self, finish: Finish | None = None, body: Any = None) -> None:
        """The request's end, in order: settle (once), the dialect's `finish` hook (the
        Responses API stores its response there, for the client's next turn), capture of
        `body` (None: no response was made), close."""
        self.settle()
        try:
            if finish is not None:
                await finish()
            if self.capture is not None:
                self.capture.send(body)
        finally:
            await self.close()

    async def close(self, *, given_up: bool = False) -> None:
        """Close every generation (the replica aborts what is unfinished), settle, and
        capture the request alone if no response was. An attempt `given_up` for a
        fallback is settled with nothing used (the prefill of a timed-out start is the
        fallback's loss, not the client's) and not captured."""
        for gen in self.gens:
            await gen.close()
        if given_up and not self._settled:
            self._settled = True
            self.pipeline._settle(self.ticket, [])
        self.settle()
        if self.capture is not None and not given_up:
            self.capture.send(None)


__all__ = ["LoadsImages", "Pipeline", "Run", "Served", "ToolPlacement", "first_user_text",
           "placed", "preparer", "text_size"]
