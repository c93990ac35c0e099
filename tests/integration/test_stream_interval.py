"""The step thread's hand-offs to the HTTP loop (`engine/async_core.py`,
`stream_interval_ms`): steps shorter than the interval go over together, a first token,
a finish and an idle engine at once, and nothing is reordered or lost. The null model
(`engine/null_model.py`) makes steps far shorter than any interval here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tokenyard.config import EngineConfig
from tokenyard.engine.async_core import AsyncEngineCore
from tokenyard.engine.core import EngineCoreOutput
from tokenyard.engine.request import Request
from tokenyard.wire.sampling_params import SamplingParams

TOKENS = 64


def _core(interval_ms: float) -> AsyncEngineCore:
    return AsyncEngineCore(EngineConfig.from_env(
        null_model=True, max_num_seqs=4, kv_cache_gib=0.05, num_threads=1,
        stream_interval_ms=interval_ms))


@pytest.fixture(scope="module", params=[0.0, 5.0, 60_000.0], ids=["every-step", "5ms", "1min"])
def core(request: pytest.FixtureRequest) -> Iterator[AsyncEngineCore]:
    engine = _core(request.param)
    yield engine
    engine.shutdown()


def _request(core: AsyncEngineCore, rid: str, n: int = TOKENS) -> Request:
    return Request(rid, list(range(300, 340)), SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True), max_model_len=core.max_model_len)


async def _hand_offs(core: AsyncEngineCore, rid: str) -> list[list[EngineCoreOutput]]:
    stream = await core.submit([_request(core, rid)])
    return [batch async for batch in stream]


def test_every_token_arrives_once_in_order_and_the_first_and_last_alone(
        core: AsyncEngineCore) -> None:
    batches = asyncio.run(_hand_offs(core, "a"))
    outs = [o for batch in batches for o in batch]
    assert sum(len(o.new_token_ids) for o in outs) == TOKENS
    assert outs[-1].finish_reason == "length"
    assert [o.finish_reason for o in outs[:-1]] == [None] * (len(outs) - 1)
    # The first token is never held: it is the first hand-off's only output.
    assert len(batches[0]) == 1 and batches[0][0].queue_time is not None
    interval = core.config.stream_interval_ms
    if interval == 0:
        assert len(batches) == TOKENS  # one hand-off a step
    elif interval >= 60_000:
        # Held until the finish, which takes everything held with it.
        assert len(batches) == 2 and len(batches[1]) == TOKENS - 1


def test_held_tokens_go_before_a_stop_from_outside() -> None:
    engine = _core(60_000.0)

    async def main() -> list[EngineCoreOutput]:
        stream = await engine.submit([_request(engine, "s", n=100_000)])
        got = [o for o in await anext(stream)]  # the first token, at once
        await asyncio.sleep(0.05)  # steps run; their tokens are held
        engine.finish_with_stop_string("s", "STOP")
        got += [o async for batch in stream for o in batch]
        return got

    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(outs) > 2  # tokens were held, then delivered before the stop
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "STOP"
    assert all(o.finish_reason is None for o in outs[:-1])


def test_a_new_requests_first_token_is_not_held_behind_a_running_one() -> None:
    """With a minute's interval, a long request's tokens are held; a second request's
    first token still goes at once, and takes the first one's held tokens with it."""
    engine = _core(60_000.0)

    async def main() -> tuple[float, int]:
        long = await engine.submit([_request(engine, "long", n=100_000)])
        await anext(long)  # its first token
        await asyncio.sleep(0.05)  # its next tokens are held
        started = time.monotonic()
        short = await engine.submit([_request(engine, "short", n=4)])
        first = await anext(short)
        waited = time.monotonic() - started
        assert first[0].queue_time is not None
        held = await anext(long)  # what was held went with that hand-off
        long.close()
        return waited, sum(len(o.new_token_ids) for o in held)

    try:
        waited, held = asyncio.run(main())
    finally:
        engine.shutdown()
    assert waited < 5  # not the minute of the interval
    assert held > 1
