"""What every handler reads: the application's state, and the values the middleware put
in each request (its id, timeline, key and, once admitted, its gateway ticket)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel

from tokenyard.api.errors import parse_body
from tokenyard.balancer.replica_client import ReplicaClient
from tokenyard.config import ServeConfig
from tokenyard.errors import model_not_found, overloaded
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.pipeline import Gateway, Ticket
from tokenyard.telemetry.metrics import TokenyardMetrics
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.prepare import Preparer
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.protocol import ReplicaInfo


@dataclass
class AppState:
    """What every handler needs: the replica's client and model, and the tokenizer."""

    client: ReplicaClient
    tokenizer: Tokenizer
    info: ReplicaInfo
    created: int
    admitting: bool = True
    metrics: TokenyardMetrics = field(default_factory=TokenyardMetrics)
    #: Keys, limits, billing and the ledger; None serves without authentication.
    gateway: Gateway | None = None
    #: Request bodies above this are refused with 413 before any parsing.
    max_body_bytes: int = ServeConfig.max_body_bytes
    #: The prepare stage over the tokenizer and the replica's context window.
    prepare: Preparer = field(init=False)

    def __post_init__(self) -> None:
        self.prepare = Preparer(self.tokenizer, self.info.max_model_len)

    @property
    def model(self) -> str:
        return self.info.model


STATE: web.AppKey[AppState] = web.AppKey("tokenyard_state")
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
TIMELINE: web.RequestKey[Timeline] = web.RequestKey("timeline", Timeline)
KEY: web.RequestKey[KeyContext] = web.RequestKey("api_key", KeyContext)
TICKET: web.RequestKey[Ticket] = web.RequestKey("ticket", Ticket)

_M = TypeVar("_M", bound=BaseModel)


async def read_request(request: web.Request, schema: type[_M]) -> _M:
    """The request's body validated into `schema` (400/413 on any client fault; 503 while
    the server shuts down), whose `model` must be the one the replica serves (404)."""
    state = request.app[STATE]
    if not state.admitting:
        raise overloaded(1.0, "The server is shutting down.")
    body = parse_body(schema, await request.read(), state.max_body_bytes)
    request[TIMELINE].mark("parsed")
    model = getattr(body, "model", None)
    if model != state.model:
        raise model_not_found(str(model))
    return body
