"""A consumer behind the engine takes the steps that queued meanwhile as one delta per
request (`wire.outputs.merge_steps`): the replica's channel writer and the gateway's
generation both do, so a lagging reader pays per batch, not per token.

The gateway's half runs a real `Generation` (output processor, SmolLM2's tokenizer) over
a replica whose deltas all arrive before the consumer reads: they come out as one output,
the text and counts the same as one per step."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_tokenizer import embedded_tokenizer
from tokenyard.balancer.generation import Generation
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.outputs import EngineCoreOutput, TokenLogprobs, merge_steps
from tokenyard.wire.protocol import CoreDelta, TokenLogprob
from tokenyard.wire.sampling_params import SamplingParams


def out(rid: str, ids: list[int], *, finish: str | None = None, first: bool = False,
        logprobs: bool = False) -> EngineCoreOutput:
    return EngineCoreOutput(
        rid, ids, [TokenLogprobs(-0.5 * t, [(t, -0.5 * t)]) for t in ids] if logprobs else None,
        finish, None, 7, 3, queue_time=0.01 if first else None,
        prefill_time=0.02 if first else None)


def test_steps_of_a_request_join_in_order_first_fields_from_the_first_rest_from_the_last(
) -> None:
    steps = [out("a", [1], first=True, logprobs=True), out("b", [9]),
             out("a", [2, 3], logprobs=True), out("b", [8], finish="length"),
             out("a", [4], finish="stop", logprobs=True)]
    a, b = merge_steps(steps)
    assert (a.request_id, a.new_token_ids, a.finish_reason) == ("a", [1, 2, 3, 4], "stop")
    assert a.new_logprobs is not None and [lp.logprob for lp in a.new_logprobs] == [
        -0.5, -1.0, -1.5, -2.0]
    assert (a.queue_time, a.prefill_time) == (0.01, 0.02)  # the first step's
    assert (b.request_id, b.new_token_ids, b.finish_reason) == ("b", [9, 8], "length")
    assert b.new_logprobs is None and b.queue_time is None
    assert steps[0].new_token_ids == [1]  # inputs untouched


def test_one_output_per_request_passes_through_as_it_is() -> None:
    steps = [out("a", [1]), out("b", [2])]
    merged = merge_steps(steps)
    assert merged == steps and all(m is s for m, s in zip(merged, steps, strict=True))
    assert merge_steps([]) == []


def test_the_http_sides_deltas_join_alike() -> None:
    deltas = [CoreDelta("x", [5], [TokenLogprob(-1.0, [])], None, None, 4, 0, 0.1, 0.2),
              CoreDelta("x", [6], [TokenLogprob(-2.0, [])], "length", None, 4, 0)]
    (one,) = merge_steps(deltas)
    assert isinstance(one, CoreDelta)
    assert one.new_token_ids == [5, 6] and one.finish_reason == "length"
    assert one.new_logprobs is not None and len(one.new_logprobs) == 2
    assert one.queue_time == 0.1


# ------------------------------------------------------------------ the gateway's half


class _Replica:
    """Yields every delta at once, so they are all queued before the consumer reads."""

    def __init__(self, deltas: list[list[int]]) -> None:
        self.deltas = deltas

    async def generate(self, cid: str, prompt: list[int], params: SamplingParams,
                       **_: Any) -> AsyncIterator[CoreDelta]:
        for i, ids in enumerate(self.deltas):
            last = i == len(self.deltas) - 1
            yield CoreDelta(cid, ids, None, "length" if last else None, None,
                            len(prompt), 0, 0.001 if i == 0 else None,
                            0.001 if i == 0 else None)

    async def stop(self, cid: str, stop: str) -> None: ...

    async def abort(self, cid: str) -> None: ...


@pytest.fixture(scope="module")
def tok(embedded_gguf_path: Path) -> Tokenizer:
    return embedded_tokenizer(embedded_gguf_path)


async def _outputs(tok: Tokenizer, per_step: list[list[int]],
                   params: SamplingParams) -> list[Any]:
    gen = Generation(_Replica(per_step), tok, "req", tok.encode("Hello"),
                     params)
    await gen.start()
    await asyncio.sleep(0.05)  # the pump queues every delta before the first read
    try:
        return [o async for o in gen]
    finally:
        await gen.close()


def test_a_consumer_behind_the_replica_gets_what_queued_as_one_output(tok: Tokenizer) -> None:
    ids = tok.encode(" The quick brown fox jumps over the lazy dog")
    per_step = [[t] for t in ids]
    params = SamplingParams(max_tokens=len(ids), temperature=0.0)
    outs = asyncio.run(_outputs(tok, per_step, params))
    # Every delta had queued before the first read: one output holds them all.
    assert len(outs) == 1
    text = "".join(d.text for o in outs for d in o.deltas)
    assert text == tok.decode(ids)
    assert [t for o in outs for d in o.deltas for t in d.token_ids] == ids
    assert outs[-1].finished and outs[-1].num_output_tokens == len(ids)
    assert outs[-1].deltas[-1].finish_reason == "length"


def test_a_stop_string_inside_the_joined_steps_still_cuts_the_text(tok: Tokenizer) -> None:
    ids = tok.encode(" one two three four five six")
    params = SamplingParams(max_tokens=len(ids), temperature=0.0, stop=[" four"])
    outs = asyncio.run(_outputs(tok, [[t] for t in ids], params))
    text = "".join(d.text for o in outs for d in o.deltas)
    assert text == " one two three"
    assert outs[-1].deltas[-1].finish_reason == "stop"


def test_a_mux_inbox_read_behind_its_reader_gives_the_queued_deltas_as_one() -> None:
    from tokenyard.balancer.mux_client import Inbox
    from tokenyard.balancer.replica_errors import ReplicaConnectionError

    async def main() -> None:
        inbox = Inbox(None, "r")  # type: ignore[arg-type]
        for i, ids in enumerate([[1], [2, 3], [4]]):
            inbox.put(CoreDelta("r", ids, None, None, None, 5, 0,
                                0.1 if i == 0 else None, 0.2 if i == 0 else None))
        one = await inbox.get()
        assert one.new_token_ids == [1, 2, 3, 4] and one.queue_time == 0.1
        inbox.put(CoreDelta("r", [5], None, None, None, 5, 0))
        inbox.put(ReplicaConnectionError("gone"))
        assert (await inbox.get()).new_token_ids == [5]  # the deltas before the error
        with pytest.raises(ReplicaConnectionError):
            await inbox.get()

    asyncio.run(main())
