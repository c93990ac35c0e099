"""A request's data on its way through the pipeline (`Call`; what its dialect's `build`
hook makes of it for the chosen deployment, `Prepared`), and what the pipeline needs of
one generation (`Generating`), whatever its deployment's kind."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.billing import Usage
from tokenyard.gateway.fallbacks import Attempt, Fallback
from tokenyard.gateway.gate import ABORTED, COMPLETED, FAILED, STOPPED, Ticket
from tokenyard.gateway.routing import Route
from tokenyard.gateway.served import Served
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.content import TemplateMessage
from tokenyard.text.tools import ToolUse
from tokenyard.wire.abort import AbortReport
from tokenyard.wire.outputs import Completion, RequestOutput
from tokenyard.wire.protocol import Pin
from tokenyard.wire.sampling_params import SamplingParams


class Generated(Protocol):
    """What an answer's rendering reads of one generation once it ran (its usage and
    finish): a `Generating`, or the sums of an MCP loop's hops (`mcp_loop.Totals`)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_cached_tokens(self) -> int: ...

    @property
    def last(self) -> RequestOutput | None:
        """The last output yielded (its counts are the generation's so far)."""
        ...

    @property
    def cache_writes(self) -> tuple[int, int]:
        """Prompt tokens its pins wrote to the cache: (kept 5 minutes, kept 1 hour)."""
        ...

    @property
    def finish_reasons(self) -> list[str | None]:
        """Each completion's finish reason once it has one ("abort" once closed)."""
        ...


class Generating(Generated, Protocol):
    """What the pipeline, its wrappers and the dialects' renderers need of one generation,
    whatever its deployment's kind (an engine's `Generation`, an upstream's
    `UpstreamGeneration`, and the moderation and shadow wrappers around either).

    `start` sends it and waits for its first output (a refusal raises before any byte is
    written); iterating yields its `RequestOutput`s; `close` ends it (the replica aborts
    what is unfinished) and is safe to call twice."""

    @property
    def stop_reasons(self) -> list[int | str | None]:
        """The stop string or stop token that ended each completion, if any."""
        ...

    @property
    def failed(self) -> bool: ...

    @property
    def abort_report(self) -> AbortReport | None:
        """What its replica had computed when it was cut before its first output (None:
        not cut so, or nothing said): the prefill that ran is billed from it."""
        ...

    @property
    def backlog(self) -> bool:
        """Whether its next output has already arrived (a stream holds its write)."""
        ...

    async def start(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def close(self) -> None: ...


class Wrapper:
    """A generation seen through a stage that changes part of it (output moderation, the
    shadow tap): every member is the wrapped generation's unless a subclass says
    otherwise."""

    def __init__(self, gen: Generating) -> None:
        self._gen = gen

    @property
    def params(self) -> SamplingParams:
        return self._gen.params

    @property
    def num_prompt_tokens(self) -> int:
        return self._gen.num_prompt_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self._gen.num_cached_tokens

    @property
    def last(self) -> RequestOutput | None:
        return self._gen.last

    @property
    def cache_writes(self) -> tuple[int, int]:
        return self._gen.cache_writes

    @property
    def finish_reasons(self) -> list[str | None]:
        return self._gen.finish_reasons

    @property
    def stop_reasons(self) -> list[int | str | None]:
        return self._gen.stop_reasons

    @property
    def failed(self) -> bool:
        return self._gen.failed

    @property
    def abort_report(self) -> AbortReport | None:
        return self._gen.abort_report

    @property
    def backlog(self) -> bool:
        return self._gen.backlog

    async def start(self) -> None:
        await self._gen.start()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._gen.__aiter__()

    async def close(self) -> None:
        await self._gen.close()


class Event(Protocol):
    """One event of an answer in its dialect's shape (a pydantic model: the gateway only
    asks for its JSON)."""

    def model_dump(self, *, mode: str) -> dict[str, Any]: ...


class Render(Protocol):
    """One answer in one dialect's shape: what `Run.complete` and `Run.stream` ask of the
    dialect's format."""

    def body(self, gens: Sequence[Generated],
             completions: Sequence[list[Completion]]) -> Event:
        """The non-streamed body; `completions[i]` are prompt i's finished choices."""
        ...

    def head(self) -> Sequence[Event]:
        """Events that go out with the first step's output, before its own."""
        ...

    def events(self, index: int, out: RequestOutput) -> Sequence[Event]:
        """The events of one step's output of prompt `index`."""
        ...

    def tail(self, gens: Sequence[Generated]) -> Sequence[Event]:
        """Events after every generation finished (a usage event)."""
        ...


#: A dialect's hook run at the request's end, before its last bytes (`Run.end`).
Finish = Callable[[], Awaitable[None]]


class Mark:
    """A point in a streamed answer that is no event (`FLUSH`, `DONE`)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: What the stream yielded so far may go out now, in one write.
FLUSH = Mark("FLUSH")
#: The answer is complete (the dialect's terminator goes here).
DONE = Mark("DONE")


class Failed(Mark):
    """The stream failed after its first byte: `error` becomes the dialect's error event."""

    def __init__(self, error: Exception) -> None:
        super().__init__("FAILED")
        self.error = error


def outcome(gens: Sequence[Generating]) -> tuple[Usage | None, str]:
    """What a request's generations used (None: none of them ran) and how it ended, as
    the ledger records it: failed if any failed, aborted if any completion was cut off or
    never finished, stopped if a stop string or stop token of the client's ended one,
    else completed. A generation cut before its first output used what its replica
    reported computing by the abort (`abort_report`: the prefill that ran); one cut
    while still queued computed nothing and is not billed."""
    ran = [gen for gen in gens if gen.last is not None]
    cut = [report for gen in gens if gen.last is None
           and (report := gen.abort_report) is not None
           and report.num_prompt_tokens + report.num_output_tokens > 0]
    usage = Usage(
        prompt_tokens=sum(gen.num_prompt_tokens for gen in ran)
        + sum(r.num_prompt_tokens for r in cut),
        cached_tokens=sum(gen.num_cached_tokens for gen in ran)
        + sum(r.num_cached_tokens for r in cut),
        output_tokens=sum(gen.last.num_output_tokens for gen in ran if gen.last is not None)
        + sum(r.num_output_tokens for r in cut),
        cache_write_5m_tokens=sum(gen.cache_writes[0] for gen in ran),
        cache_write_1h_tokens=sum(gen.cache_writes[1] for gen in ran),
    ) if ran or cut else None
    reasons = [reason for gen in gens for reason in gen.finish_reasons]
    if any(gen.failed for gen in gens):
        status = FAILED
    elif "abort" in reasons or None in reasons:
        status = ABORTED
    elif any(isinstance(r, str) or r in gen.params.stop_token_ids
             for gen in gens for r in gen.stop_reasons if r is not None):
        status = STOPPED
    else:
        status = COMPLETED
    return usage, status


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
    #: The candidates the request names after `model` (`gateway/fallbacks.py`); empty:
    #: the fleet file's fallbacks of `model`, if any.
    fallbacks: Sequence[Fallback] = ()
    # Filled in as the request goes, for the caller's summary and headers, whether or
    # not it got through:
    route: Route | None = None
    served: Served | None = None
    ticket: Ticket | None = None
    gens: list[Generating] = field(default_factory=list)
    #: Every candidate tried, when the request had fallbacks (None: it had none).
    attempts: list[Attempt] | None = None
    #: Whether the request took its one request from the key's RPM already (an attempt
    #: admitted before a fallback's, or its admission before its MCP servers were
    #: contacted): a later admission takes none. Kept by `retarget`.
    counted: bool = False

    def retarget(self, model: str, build: Build) -> None:
        """Aim the call at another candidate (a fallback), clearing what the last
        attempt left."""
        self.model, self.build = model, build
        self.route = self.served = self.ticket = None
        self.gens = []
