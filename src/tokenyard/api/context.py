"""What every handler reads: the application's state (the fleet: its deployments and its
router), and the values the middleware put in each request (its id, timeline, key and,
once admitted, its gateway ticket)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from tokenyard.api.edge import EdgeLimits
from tokenyard.api.errors import parse_body
from tokenyard.balancer.pool import Pool
from tokenyard.config import ServeConfig
from tokenyard.deployments import DeploymentSpec, FleetSpec
from tokenyard.errors import overloaded
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.pipeline import Gateway, Ticket
from tokenyard.gateway.routing import Route, Router, conversation_key, require
from tokenyard.telemetry.metrics import TokenyardMetrics
from tokenyard.telemetry.timeline import Timeline
from tokenyard.telemetry.tracing import TraceIds
from tokenyard.text.prepare import Preparer
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.replica_info import ReplicaInfo


@dataclass(eq=False)
class Served:
    """One deployment as this process serves it: its spec, its pool of replicas and, for
    the kinds that need them here, its tokenizer and model facts."""

    spec: DeploymentSpec
    pool: Pool
    created: int
    #: The tokenizer prompts are prepared with (an upstream's: ours, for estimates).
    tokenizer: Tokenizer | None = None
    #: The engine's model facts (context window, vocabulary); None for other kinds.
    info: ReplicaInfo | None = None
    prepare: Preparer | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.tokenizer is not None:
            window = (self.info.max_model_len if self.info is not None
                      else self.spec.max_context or 1 << 20)
            self.prepare = Preparer(self.tokenizer, window)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def vocab_size(self) -> int | None:
        return self.info.vocab_size if self.info is not None else None


@dataclass
class AppState:
    """What every handler needs: the deployments this process serves and their router."""

    deployments: dict[str, Served]
    router: Router
    created: int
    admitting: bool = True
    metrics: TokenyardMetrics = field(default_factory=TokenyardMetrics)
    #: Keys, limits, billing and the ledger; None serves without authentication.
    gateway: Gateway | None = None
    #: Request bodies above this are refused with 413 before any parsing.
    max_body_bytes: int = ServeConfig.max_body_bytes
    #: Per client address: connections, request rate, header timeout and size.
    edge: EdgeLimits = field(default_factory=EdgeLimits)
    #: Embeddings deployments by name → what their route calls.
    embeddings: dict[str, Any] = field(default_factory=dict)
    #: Pools of removed deployments still finishing their requests.
    retired: list[Pool] = field(default_factory=list)

    @classmethod
    def single(cls, served: Served, created: int) -> AppState:
        """The state of one deployment and no aliases."""
        fleet = FleetSpec({served.name: served.spec})
        return cls({served.name: served}, Router(fleet), created)

    @property
    def default(self) -> Served:
        """The first chat deployment (what a bare `tokenyard serve` serves)."""
        for served in self.deployments.values():
            if served.kind != "embeddings":
                return served
        return next(iter(self.deployments.values()))

    @property
    def model(self) -> str:
        return self.default.name

    def replace_fleet(self, fleet: FleetSpec, deployments: dict[str, Served]) -> list[Pool]:
        """Swap in a reloaded fleet; returns the pools no deployment uses any more (the
        caller drains and closes them)."""
        kept = {id(s.pool) for s in deployments.values()}
        gone = [s.pool for s in self.deployments.values() if id(s.pool) not in kept]
        self.deployments = deployments
        self.router = Router(fleet)
        return gone


STATE: web.AppKey[AppState] = web.AppKey("tokenyard_state")
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
TIMELINE: web.RequestKey[Timeline] = web.RequestKey("timeline", Timeline)
KEY: web.RequestKey[KeyContext] = web.RequestKey("api_key", KeyContext)
TICKET: web.RequestKey[Ticket] = web.RequestKey("ticket", Ticket)
ROUTE: web.RequestKey[Route] = web.RequestKey("route", Route)
#: The generations of a generating request (what the request's summary reads).
GENERATIONS: web.RequestKey[list[Any]] = web.RequestKey("generations", list)
#: The API error code of a request that failed (before or after its 200).
ERROR_CODE: web.RequestKey[str] = web.RequestKey("error_code", str)
#: The response's own id (``chatcmpl-…``, ``msg_…``), for the trace's gen_ai.response.id.
RESPONSE_ID: web.RequestKey[str] = web.RequestKey("response_id", str)
#: The request's span ids, when traces are exported (telemetry/tracing.py).
TRACE: web.RequestKey[TraceIds] = web.RequestKey("trace", TraceIds)

_M = TypeVar("_M", bound=BaseModel)


async def read_request(request: web.Request, schema: type[_M]) -> _M:
    """The request's body validated into `schema` (400/413 on any client fault; 503 while
    the server shuts down)."""
    state = request.app[STATE]
    if not state.admitting:
        raise overloaded(1.0, "The server is shutting down.")
    body = parse_body(schema, await request.read(), state.max_body_bytes)
    request[TIMELINE].mark("parsed")
    return body


def route(
    request: web.Request, model: str, capability: str, *, first_user_text: str | None = None,
) -> Served:
    """Stage 9: the deployment that serves this request (404 for an unknown name; 400 if
    it lacks `capability`). The route, with its shadow, waits in the request."""
    state = request.app[STATE]
    chosen = state.router.resolve(model, conversation_key(first_user_text))
    served = state.deployments[chosen.deployment]
    require(served.spec, capability)
    request[ROUTE] = chosen
    return served
