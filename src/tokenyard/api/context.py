"""What every handler reads: the application's state (the fleet: its deployments and its
router), its pipeline, and the values the middleware and the pipeline put in each request
(its id, timeline, key and, once admitted, its gateway ticket)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from aiohttp import web
from pydantic import BaseModel

from tokenyard.api.edge import EdgeLimits
from tokenyard.api.errors import parse_body
from tokenyard.config import ServeConfig
from tokenyard.deployments import DeploymentSpec, FleetSpec
from tokenyard.errors import overloaded
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.background import BackgroundSettings
from tokenyard.gateway.batches import BatchSettings
from tokenyard.gateway.gate import Ticket
from tokenyard.gateway.pipeline import Pipeline
from tokenyard.gateway.routing import Route, Router
from tokenyard.gateway.served import Fleet, Served
from tokenyard.telemetry.timeline import Timeline
from tokenyard.telemetry.tracing import TraceIds


class ReplicaScaler(Protocol):
    """Scales a deployment whose replicas Ray places (`cli/ray_admin.py`'s `RayScaler`);
    each method answers the live replicas, as {"name", "url"}."""

    async def scale(self, spec: DeploymentSpec, count: int) -> list[dict[str, str]]: ...

    async def replicas(self, spec: DeploymentSpec) -> list[dict[str, str]]: ...


@dataclass
class AppState(Fleet):
    """What every handler needs: the fleet the pipeline serves (its deployments, their
    router, the gateway), and what only HTTP needs."""

    admitting: bool = True
    #: Request bodies above this are refused with 413 before any parsing.
    max_body_bytes: int = ServeConfig.max_body_bytes
    #: Per client address: connections, request rate, header timeout and size.
    edge: EdgeLimits = field(default_factory=EdgeLimits)
    #: What scales the Ray-placed deployments (None: this process serves none).
    scaler: ReplicaScaler | None = None
    #: The Batch API lane's settings (`ServeConfig`'s `batch_*`: serve's flags).
    batch: BatchSettings = field(default_factory=BatchSettings)
    #: The background responses' lane's (`ServeConfig`'s `background_*`: serve's config).
    background: BackgroundSettings = field(default_factory=BackgroundSettings)

    @classmethod
    def single(cls, served: Served, created: int) -> AppState:
        """The state of one deployment and no aliases."""
        fleet = FleetSpec({served.name: served.spec})
        return cls({served.name: served}, Router(fleet), created)


STATE: web.AppKey[AppState] = web.AppKey("tokenyard_state")
#: The request pipeline over the state's fleet (gateway/pipeline.py).
PIPELINE: web.AppKey[Pipeline] = web.AppKey("tokenyard_pipeline", Pipeline)
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
TIMELINE: web.RequestKey[Timeline] = web.RequestKey("timeline", Timeline)
KEY: web.RequestKey[KeyContext] = web.RequestKey("api_key", KeyContext)
TICKET: web.RequestKey[Ticket] = web.RequestKey("ticket", Ticket)
ROUTE: web.RequestKey[Route] = web.RequestKey("route", Route)
#: The generations of a generating request (what the request's summary reads).
GENERATIONS: web.RequestKey[list[Any]] = web.RequestKey("generations", list)
#: The candidates a request with fallbacks tried (gateway/fallbacks.py's `Attempt`s).
ATTEMPTS: web.RequestKey[list[Any]] = web.RequestKey("attempts", list)
#: The API error code of a request that failed (before or after its 200).
ERROR_CODE: web.RequestKey[str] = web.RequestKey("error_code", str)
#: The status of the error a stream ended in after its 200 (what its record says).
STREAM_ERROR_STATUS: web.RequestKey[int] = web.RequestKey("stream_error_status", int)
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

