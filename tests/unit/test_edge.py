"""The edge's per-address limits (api/edge.py) on a bare aiohttp app served the way every
HTTP process serves: connections past the limit are answered 429 then closed, past twice
the limit closed at accept; the request bucket refills at its rate; a request head that
does not arrive within the header timeout loses its connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from tokenyard.api.edge import EDGE, AddressRate, Edge, EdgeLimits, edge_runner, start_edge
from tokenyard.api.respond import _send
from tokenyard.errors import APIError

PROBE = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


@asynccontextmanager
async def served(limits: EdgeLimits) -> AsyncIterator[tuple[int, Edge]]:
    """A one-route app behind the edge on a free port: the port and the app's Edge."""
    @web.middleware
    async def admit(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        try:
            request.app[EDGE].admit(request)
        except APIError as err:
            return web.json_response({"code": err.code}, status=err.status)
        return await handler(request)

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[admit])
    app[EDGE] = Edge(limits)
    app.router.add_get("/", ok)
    runner = edge_runner(app, shutdown_timeout=1)
    await start_edge(runner)
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield runner.addresses[0][1], app[EDGE]
    finally:
        await runner.cleanup()


async def _status(reader: asyncio.StreamReader) -> int | None:
    """The status of the response on a raw connection, None if it was closed unanswered."""
    try:
        line = await asyncio.wait_for(reader.readline(), 5)
    except ConnectionError:
        return None
    return int(line.split()[1]) if line else None


def test_connections_past_the_limit_get_429_then_past_twice_it_are_closed() -> None:
    async def scenario() -> tuple[list[int | None], int | None, dict[str, int]]:
        async with served(EdgeLimits(2, 0, 5, 4096)) as (port, edge):
            conns = [await asyncio.open_connection("127.0.0.1", port,
                                                   local_addr=("127.0.0.3", 0))
                     for _ in range(5)]
            await asyncio.sleep(0.1)  # all five accepted before any request is sent
            for _, writer in conns:
                writer.write(PROBE)
            statuses = [await _status(reader) for reader, _ in conns]
            # Another address is unaffected.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(PROBE)
            other = await _status(reader)
            for _, w in [*conns, (reader, writer)]:
                w.close()
            return statuses, other, edge.guard.open

    statuses, other, still_open = asyncio.run(scenario())
    assert statuses == [200, 200, 429, 429, None] and other == 200
    assert still_open.get("127.0.0.3", 0) <= 2


def test_a_head_slower_than_the_header_timeout_loses_its_connection() -> None:
    async def scenario() -> tuple[float, int | None]:
        async with served(EdgeLimits(0, 0, 0.5, 4096)) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = asyncio.get_running_loop().time()
            try:
                for byte in PROBE[:-2] + b"X-Slow: " + b"a" * 200:  # a head never ending
                    writer.write(bytes([byte]))
                    await asyncio.sleep(0.02)
                    # Closed: a FIN (EOF), or an RST when the server closed with bytes of
                    # ours unread (then writes are dropped silently and only the reader's
                    # exception and the transport tell).
                    if reader.at_eof() or reader.exception() is not None or writer.is_closing():
                        break
                assert await asyncio.wait_for(reader.read(), 5) == b""
            except ConnectionError:  # the server closed it under the trickle
                pass
            took = asyncio.get_running_loop().time() - started
            writer.close()
            # A whole head in time is served.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(PROBE)
            status = await _status(reader)
            writer.close()
            return took, status

    took, status = asyncio.run(scenario())
    assert 0.4 < took < 2.0 and status == 200


def test_the_address_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    rate = AddressRate(2, clock=lambda: now[0])
    rate.take("a")
    rate.take("a")
    with pytest.raises(APIError) as refused:
        rate.take("a")
    assert refused.value.status == 429 and refused.value.headers["retry-after"] == "1"
    rate.take("b")  # each address has its own bucket
    now[0] = 0.5  # half a second: one more request
    rate.take("a")
    with pytest.raises(APIError):
        rate.take("a")
    AddressRate(0).take("a")  # 0: no limit


def test_a_stream_write_the_client_does_not_take_is_cut_at_the_write_timeout() -> None:
    """A client that stopped reading: the write never completes. The stream is ended as a
    disconnect (which frees its generation and slots and settles it), not waited on."""
    class StalledResponse:
        async def write(self, data: bytes) -> None:
            await asyncio.Event().wait()  # the socket never drains

    class Transport:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

        def get_extra_info(self, name: str, default: object = None) -> object:
            return default

    async def scenario() -> tuple[float, bool]:
        app = web.Application()
        app[EDGE] = Edge(EdgeLimits(stream_write_timeout_s=0.2))
        transport = Transport()
        request = make_mocked_request("POST", "/v1/chat/completions", app=app,
                                      transport=transport)
        started = asyncio.get_running_loop().time()
        with pytest.raises(ConnectionResetError):
            # Bounded here, so that without the timeout this fails rather than hangs.
            await asyncio.wait_for(_send(request, StalledResponse(),  # type: ignore[arg-type]
                                         [b"data: {}\n\n"]), 5)
        return asyncio.get_running_loop().time() - started, transport.aborted

    took, aborted = asyncio.run(scenario())
    assert aborted and 0.15 < took < 2.0
