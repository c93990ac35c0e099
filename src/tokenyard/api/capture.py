"""Body capture of a generating request, for the orgs that turned it on.

`capture_of` decides once, after admission, from the gateway's in-memory list of
capturing orgs (no database read); for every other request it is None and nothing below
runs. The response captured is the body the client got; for a stream, the body the same
request would have got unstreamed, built by the dialect's `Format` from the deltas the
stream sent. Redaction, cutting and the write happen in the gateway's request log, off
the request path (`gateway/requests.py`). A request that failed or was cancelled is
captured without a response.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from aiohttp import web

from tokenyard.api.context import KEY, REQUEST_ID, STATE
from tokenyard.balancer.generation import Generation
from tokenyard.gateway.auth import KeyContext
from tokenyard.gateway.requests import RequestLog
from tokenyard.wire.outputs import Completion, RequestOutput


class _Builds(Protocol):
    def body(self, gens: Sequence[Generation], completions: Sequence[list[Completion]]) -> Any:
        ...


async def capture_of(request: web.Request) -> BodyCapture | None:
    """The request's capture when its org captures bodies, else None."""
    gateway, key = request.app[STATE].gateway, request.get(KEY)
    if gateway is None or key is None or not gateway.requests.capturing(key):
        return None
    return BodyCapture(gateway.requests, request[REQUEST_ID], key, await request.read())


class BodyCapture:
    """One request's bodies on their way to the request log."""

    def __init__(self, log: RequestLog, request_id: str, key: KeyContext, raw: bytes) -> None:
        self.log, self.request_id, self.key, self.raw = log, request_id, key, raw
        self.completions: list[list[Completion]] = []
        self.sent = False

    def watch(self, gens: Sequence[Generation]) -> None:
        """Collect a stream's deltas from now on (`add`)."""
        self.completions = [[Completion(index=j) for j in range(gen.params.n)] for gen in gens]

    def add(self, index: int, out: RequestOutput) -> None:
        for delta in out.deltas:
            self.completions[index][delta.index].add(delta)

    def streamed_body(self, fmt: _Builds, gens: Sequence[Generation]) -> Any:
        """The unstreamed body of what the stream sent."""
        return fmt.body(gens, self.completions)

    def send(self, response: Any) -> None:
        """Queue the bodies (`response` None: none was made), once."""
        if not self.sent:
            self.sent = True
            self.log.capture(self.request_id, self.key, self.raw, response)
