"""A request's data on its way through the pipeline (`Call`; what its dialect's `build`
hook makes of it for the chosen deployment, `Prepared`), and what the pipeline needs of
one generation (`Generating`), whatever its deployment's kind."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenyard.balancer.generation import Generation
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.gate import Ticket
from tokenyard.gateway.routing import Route
from tokenyard.gateway.served import Served
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.content import TemplateMessage
from tokenyard.text.tools import ToolUse
from tokenyard.wire.outputs import RequestOutput
from tokenyard.wire.protocol import Pin
from tokenyard.wire.sampling_params import SamplingParams


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
