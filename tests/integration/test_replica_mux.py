"""The multiplexed channel between the HTTP side and a replica (`wire/mux.py`), against a
replica server in this process running the null model (`engine/null_model.py`): the real
scheduler, runner, sampler, channel and client, around a forward pass that costs nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest
from aiohttp import web

from tokenyard.balancer import mux_client
from tokenyard.balancer.replica_client import ReplicaClient, ReplicaConnectionError
from tokenyard.config import EngineConfig
from tokenyard.engine.async_core import AsyncEngineCore
from tokenyard.engine.server import ReplicaServer
from tokenyard.wire.protocol import CoreDelta
from tokenyard.wire.sampling_params import SamplingParams

T = TypeVar("T")
STREAMS = 16


@pytest.fixture(scope="module")
def engine() -> AsyncIterator[AsyncEngineCore]:
    core = AsyncEngineCore(EngineConfig.from_env(null_model=True, max_num_seqs=STREAMS,
                                                 kv_cache_gib=0.05, num_threads=1))
    yield core  # type: ignore[misc]
    core.shutdown()


def serve(engine: AsyncEngineCore,
          scenario: Callable[[ReplicaClient, web.AppRunner], Awaitable[T]]) -> T:
    """Run `scenario` with a client of a replica server over `engine` on a free port."""

    async def main() -> T:
        runner = web.AppRunner(ReplicaServer(engine).make_app(), handler_cancellation=True)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            async with ReplicaClient(url) as client:
                return await scenario(client, runner)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def tokens(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def drain(stream: AsyncIterator[CoreDelta]) -> list[CoreDelta]:
    return [delta async for delta in stream]


async def wait_idle(engine: AsyncEngineCore, within: float) -> None:
    deadline = time.monotonic() + within
    while engine.stats().num_running or engine.stats().num_waiting:
        assert time.monotonic() < deadline, f"not idle after {within} s: {engine.stats()}"
        await asyncio.sleep(0.01)


def test_one_connection_carries_every_request_and_a_frame_carries_a_step_of_them(
    engine: AsyncEngineCore, monkeypatch: pytest.MonkeyPatch,
) -> None:
    frames: list[int] = []  # requests with a delta in each frame the client read
    deliver = mux_client._Conn._deliver

    def counted(self: mux_client._Conn, data: bytes) -> None:
        frames.append(data.count(b'"request_id"'))
        deliver(self, data)

    monkeypatch.setattr(mux_client._Conn, "_deliver", counted)

    async def scenario(client: ReplicaClient, runner: web.AppRunner) -> list[list[CoreDelta]]:
        streams = [client.generate(f"r{i}", [300 + i, 400, 500], tokens(24))
                   for i in range(STREAMS)]
        firsts = await asyncio.gather(*(anext(s) for s in streams))
        # Every request open: the replica sees one connection (the channel), not one each.
        assert runner.server is not None and len(runner.server.connections) == 1
        rests = await asyncio.gather(*(drain(s) for s in streams))
        return [[first, *rest] for first, rest in zip(firsts, rests, strict=True)]

    outs = serve(engine, scenario)
    for deltas in outs:
        assert sum(len(d.new_token_ids) for d in deltas) == 24
        assert deltas[-1].finish_reason == "length"
    deltas_sent = sum(frames)
    # A caller behind its reader gets the deltas queued meanwhile joined into one
    # (mux_client.Inbox): it reads at most what the frames carried.
    assert sum(len(d) for d in outs) <= deltas_sent
    # Decode steps of all 16 streams travel together: far fewer frames than deltas. A
    # reader slower than the engine (a loaded machine) gets the steps it has not taken
    # together in one frame (one delta per request), so a frame holds at least one whole
    # step, maybe several.
    assert len(frames) < deltas_sent / 4 and max(frames) >= STREAMS


def test_a_caller_that_leaves_early_aborts_its_request_alone(engine: AsyncEngineCore) -> None:
    async def scenario(client: ReplicaClient, runner: web.AppRunner) -> list[CoreDelta]:
        stays = client.generate("stays", [301, 302], tokens(64))
        leaves = client.generate("leaves", [303, 304], tokens(100_000 // 64))
        await anext(stays)
        for _ in range(3):
            await anext(leaves)
        await leaves.aclose()  # the abort goes on the channel; the channel stays
        rest = await drain(stays)
        await wait_idle(engine, within=2.0)
        return rest

    rest = serve(engine, scenario)
    assert rest[-1].finish_reason == "length"


def test_requests_open_when_the_connection_drops_fail_with_a_connection_error(
    engine: AsyncEngineCore,
) -> None:
    async def scenario(client: ReplicaClient, runner: web.AppRunner) -> BaseException:
        stream = client.generate("cut", [305, 306], tokens(100_000 // 64))
        await anext(stream)
        assert runner.server is not None
        for connection in list(runner.server.connections):
            connection.force_close()  # the replica's end of the channel goes away
        with pytest.raises(ReplicaConnectionError) as failed:
            await drain(stream)
        await wait_idle(engine, within=2.0)  # the replica aborted what the link left
        return failed.value

    assert "closed" in str(serve(engine, scenario))
