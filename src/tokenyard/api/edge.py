"""The edge (DESIGN stage 2): what one client address may take of the HTTP process before
any route, key or body is looked at.

- Connections: at most `connections_per_address` open at once per TCP peer address; a
  connection past that is answered 429 (in the route's dialect) at its first request and
  closed. (Closing it at accept would reset it under the client's request instead, and
  the client would see a connection error rather than why.) Past twice the limit a
  connection is closed at accept, unanswered: a flood must not hold file descriptors.
- Requests: a token bucket per address, `requests_per_s` refilled each second, as deep as
  one second's worth; an empty bucket answers 429 with retry-after in the route's dialect.
- Slowloris: a request head must arrive whole within `header_timeout_s` of the connection
  opening or of its previous response, else the connection is closed. This is aiohttp's
  keep-alive timer, which is armed at connect and after each response and is not pushed
  back by bytes that arrive meanwhile; it never fires while a handler runs, so long
  streams are untouched.
- Header size: a request line or header field over `max_header_bytes` is refused by
  aiohttp's parser (400/431) before a handler runs.
- Slow readers: a stream's write waits for the socket to drain (aiohttp's back-pressure:
  at most 64 KiB buffered per response), so a client that stops reading costs no memory,
  but its handler would wait forever, holding its generation and its limits' slots, never
  billed. A write that takes over `stream_write_timeout_s` closes the connection instead
  (`respond._send`), which ends the request as a client disconnect does.

Addresses are TCP peers, never a header a client could set; behind a proxy every client
shares the proxy's address, so raise the figures there (0 turns a limit off). The counts
live in this process: with `--workers N` each worker keeps its own.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tokenyard.config import ServeConfig
from tokenyard.errors import rate_limited


@dataclass(frozen=True)
class EdgeLimits:
    """The edge's figures (ServeConfig's `edge_*`, `header_timeout_s`, `max_header_bytes`)."""

    connections_per_address: int = ServeConfig.edge_connections_per_address
    requests_per_s: float = ServeConfig.edge_requests_per_s
    header_timeout_s: float = ServeConfig.header_timeout_s
    max_header_bytes: int = ServeConfig.max_header_bytes
    stream_write_timeout_s: float = ServeConfig.stream_write_timeout_s

    @classmethod
    def of(cls, config: ServeConfig) -> EdgeLimits:
        return cls(config.edge_connections_per_address, config.edge_requests_per_s,
                   config.header_timeout_s, config.max_header_bytes,
                   config.stream_write_timeout_s)


class AddressRate:
    """A token bucket per client address: (tokens, when last refilled), in a bounded
    table (the least recently seen address is forgotten first)."""

    def __init__(self, per_s: float, *, max_addresses: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_s = per_s
        self._max_addresses = max_addresses
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, address: str | None) -> None:
        """Spend one request of `address`'s bucket, or raise 429 when it is empty."""
        if self.per_s <= 0 or address is None:
            return
        now = self._clock()
        tokens, then = self._buckets.get(address, (self.per_s, now))
        tokens = min(self.per_s, tokens + (now - then) * self.per_s)
        if tokens < 1.0:
            self._buckets[address] = (tokens, now)
            wait = (1.0 - tokens) / self.per_s
            raise rate_limited(
                f"Too many requests from this address (limit {self.per_s:g} per second); "
                f"retry in {math.ceil(wait)} s.", retry_after_s=wait)
        self._buckets[address] = (tokens - 1.0, now)
        self._buckets.move_to_end(address)
        while len(self._buckets) > self._max_addresses:
            self._buckets.popitem(last=False)


class ConnectionGuard:
    """Counts open connections per peer address on an aiohttp `web.Server`, marks the ones
    past `limit` as refused and closes the ones past twice `limit` at once; `refused`
    counts both, for tests and logs."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: dict[str, int] = {}
        self.refused = 0
        self._counted: dict[int, str] = {}  # id(handler) → its address, while open
        self._over: set[int] = set()  # id(handler) of connections past the limit

    def install(self, server: web.Server) -> None:
        """Wrap `server`'s connection hooks, which every RequestHandler calls."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self._opened(handler, transport)

        def connection_lost(handler: Any, exc: BaseException | None) -> None:
            self._closed(handler)
            lost(handler, exc)

        # The hooks are plain methods of web.Server; instance attributes shadow them.
        setattr(server, "connection_made", connection_made)  # noqa: B010
        setattr(server, "connection_lost", connection_lost)  # noqa: B010

    def over_limit(self, handler: object) -> bool:
        """Whether the connection of `handler` (a request's `protocol`) is past its limit."""
        return id(handler) in self._over

    def _opened(self, handler: Any, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) and peer else None
        if self.limit <= 0 or not isinstance(address, str):
            return
        already = self.open.get(address, 0)
        if already >= self.limit:
            self.refused += 1
            if already >= 2 * self.limit:
                transport.close()  # connection_lost follows; this one is not counted
                return
            self._over.add(id(handler))
        self.open[address] = already + 1
        self._counted[id(handler)] = address

    def _closed(self, handler: Any) -> None:
        self._over.discard(id(handler))
        address = self._counted.pop(id(handler), None)
        if address is None:
            return
        left = self.open[address] - 1
        if left:
            self.open[address] = left
        else:
            del self.open[address]


class Edge:
    """The edge of one HTTP process: its connection guard and its per-address rate."""

    def __init__(self, limits: EdgeLimits) -> None:
        self.limits = limits
        self.guard = ConnectionGuard(limits.connections_per_address)
        self.rate = AddressRate(limits.requests_per_s)

    def admit(self, request: web.Request) -> None:
        """Raise 429 for a request on a connection past its address's limit (which then
        closes), or past its address's rate."""
        if self.guard.over_limit(request.protocol):
            request.protocol.close()  # once this answer is out: the slot is not its own
            raise rate_limited("Too many open connections from this address.",
                               retry_after_s=1.0, code="too_many_connections")
        self.rate.take(request.remote)


#: The application's Edge, which the middleware asks about every request.
EDGE: web.AppKey[Edge] = web.AppKey("edge", Edge)


def edge_runner(app: web.Application, *, shutdown_timeout: float) -> web.AppRunner:
    """The AppRunner every HTTP process serves `app` with: handler cancellation (a client
    that goes away cancels its handler, which aborts its replica request and frees its
    blocks), no access log (the request log has it), and the edge's header limits."""
    limits = app[EDGE].limits
    return web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout,
        keepalive_timeout=limits.header_timeout_s, max_line_size=limits.max_header_bytes,
        max_field_size=limits.max_header_bytes)


async def start_edge(runner: web.AppRunner) -> None:
    """Set `runner` up and guard its connections; the caller then starts its site."""
    await runner.setup()
    assert runner.server is not None
    runner.app[EDGE].guard.install(runner.server)
