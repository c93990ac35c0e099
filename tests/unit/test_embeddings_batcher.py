"""The dynamic batcher: concurrent requests share forward passes, a pass stays within its
token budget with inputs of similar lengths together, a request that went away is not
computed, a full queue refuses at once, and a failing pass fails only its requests.

`encode` here is a plain function that records the batches it gets and returns each
input's ids as float32 bytes, so every answer can be checked against its input."""

from __future__ import annotations

import asyncio
import struct
import threading
from typing import Any

import pytest

from tokenyard.engine.embed.batcher import DynamicBatcher, QueueFull


class Recorder:
    """An encode that records its batches; `gate` (when set) holds each pass until opened."""

    def __init__(self, gate: threading.Event | None = None, fail_on: int | None = None):
        self.batches: list[list[list[int]]] = []
        self.gate = gate
        self.fail_on = fail_on

    def __call__(self, inputs: list[list[int]]) -> list[bytes]:
        self.batches.append(inputs)
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail_on is not None and any(self.fail_on in ids for ids in inputs):
            raise RuntimeError("the pass failed")
        return [struct.pack(f"<{len(ids)}f", *ids) for ids in inputs]


def _floats(raw: bytes) -> list[int]:
    return [int(v) for v in struct.unpack(f"<{len(raw) // 4}f", raw)]


def _run(coro_fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    return asyncio.run(coro_fn(*args, **kwargs))


async def _with_batcher(encode: Recorder, body, **bounds):  # type: ignore[no-untyped-def]
    batcher = DynamicBatcher(encode, **bounds)
    batcher.start()
    try:
        return await body(batcher)
    finally:
        await batcher.stop()


async def _hold_a_pass(batcher: DynamicBatcher, encode: Recorder,
                       ids: list[int]) -> asyncio.Future[Any]:
    """Embed `ids` and return once its pass has begun (and is held at `encode`'s gate)."""
    running = asyncio.ensure_future(batcher.embed([ids]))
    while not encode.batches:
        await asyncio.sleep(0.001)
    return running


def test_requests_arriving_during_a_pass_share_the_next_one() -> None:
    gate = threading.Event()
    encode = Recorder(gate)

    async def body(batcher: DynamicBatcher) -> None:
        first = await _hold_a_pass(batcher, encode, [1, 2])
        rest = [asyncio.ensure_future(batcher.embed([[i, i + 1, i + 2]])) for i in range(15)]
        await asyncio.sleep(0.01)
        gate.set()
        results = await asyncio.gather(first, *rest)
        assert _floats(results[0].vectors[0]) == [1, 2]
        for i, done in enumerate(results[1:]):
            assert _floats(done.vectors[0]) == [i, i + 1, i + 2]
        assert batcher.stats.forward_passes == 2
        assert batcher.stats.requests == 16 and batcher.stats.inputs == 16

    _run(_with_batcher, encode, body)
    assert [len(b) for b in encode.batches] == [1, 15]


def test_a_pass_stays_within_its_token_budget_and_groups_similar_lengths() -> None:
    gate = threading.Event()
    encode = Recorder(gate)
    lengths = [30, 2, 29, 3, 31, 1, 2, 30]

    async def body(batcher: DynamicBatcher) -> None:
        blocker = await _hold_a_pass(batcher, encode, [7])
        request = asyncio.ensure_future(batcher.embed([[5] * n for n in lengths]))
        await asyncio.sleep(0.01)
        gate.set()
        await blocker
        done = await request
        assert [len(_floats(v)) for v in done.vectors] == lengths  # request order kept
        assert batcher.stats.tokens == 1 + sum(lengths)

    _run(_with_batcher, encode, body, max_batch_tokens=64)
    passes = encode.batches[1:]
    for batch in passes:
        assert len(batch) * max(len(ids) for ids in batch) <= 64
    # Sorted by length: the four short inputs pad to 3 in one pass, not to 31.
    assert [[len(ids) for ids in batch] for batch in passes] == [[1, 2, 2, 3], [29, 30],
                                                                 [30, 31]]


def test_inputs_of_a_request_that_went_away_are_never_computed() -> None:
    gate = threading.Event()
    encode = Recorder(gate)

    async def body(batcher: DynamicBatcher) -> None:
        blocker = await _hold_a_pass(batcher, encode, [1])
        gone = asyncio.ensure_future(batcher.embed([[99, 99]]))
        kept = asyncio.ensure_future(batcher.embed([[3, 3, 3]]))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        gate.set()
        await blocker
        assert _floats((await kept).vectors[0]) == [3, 3, 3]

    _run(_with_batcher, encode, body)
    assert all(99 not in ids for batch in encode.batches for ids in batch)


def test_a_full_queue_refuses_at_once() -> None:
    gate = threading.Event()
    encode = Recorder(gate)

    async def body(batcher: DynamicBatcher) -> None:
        blocker = await _hold_a_pass(batcher, encode, [1])
        waiting = asyncio.ensure_future(batcher.embed([[2]] * 3))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull):
            await batcher.embed([[3]] * 2)
        gate.set()
        await asyncio.gather(blocker, waiting)

    _run(_with_batcher, encode, body, max_waiting_inputs=4)


def test_a_failing_pass_fails_its_requests_and_the_batcher_goes_on() -> None:
    encode = Recorder(fail_on=13)

    async def body(batcher: DynamicBatcher) -> None:
        with pytest.raises(RuntimeError, match="the pass failed"):
            await batcher.embed([[13, 1]])
        assert batcher.is_running
        done = await batcher.embed([[4, 5]])
        assert _floats(done.vectors[0]) == [4, 5]

    _run(_with_batcher, encode, body)
