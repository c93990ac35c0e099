"""`AsyncEngineCore.abort_report` on the embedded model (issue 21, finding 5): an abort
answers what the request had computed — the prompt tokens a request cut during its
prefill ran through the model, none for one still waiting — which the replica's abort
route sends back so that the gateway bills the prefill of a client that left early.

The engine runs 16 tokens a step and one sequence at a time, so a 600-token prompt is
prefilled over dozens of steps and a second request waits behind a first one.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from tokenyard.engine.async_llm import AsyncLLM
from tokenyard.engine.frontend import make_request
from tokenyard.wire.abort import AbortReport
from tokenyard.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)


def test_an_abort_reports_the_prefill_that_ran_and_nothing_for_a_waiting_request() -> None:
    llm = AsyncLLM(max_num_batched_tokens=16, max_num_seqs=1)
    engine = llm.engine
    rng = random.Random(21)
    prompt = [rng.randrange(100, 20_000) for _ in range(600)]

    async def idle() -> int:
        for _ in range(1000):
            stats = engine.stats()
            if stats.num_running == stats.num_waiting == 0:
                return stats.num_computed_tokens
            await asyncio.sleep(0.01)
        raise AssertionError("the engine did not go idle")

    async def scenario() -> tuple[AbortReport | None, int, AbortReport | None,
                                  AbortReport | None, list[str | None]]:
        before = await idle()
        first = make_request("prefilling", prompt, PARAMS, engine.eos_token_ids)
        queued = make_request("queued", prompt[:40], PARAMS, engine.eos_token_ids)
        stream = await engine.submit([first])
        behind = await engine.submit([queued])
        while engine.stats().num_computed_tokens - before < 160:
            await asyncio.sleep(0.002)
        waiting = await engine.abort_report("queued")
        cut = await engine.abort_report("prefilling")
        computed = await idle() - before
        unknown = await engine.abort_report("prefilling")  # already ended
        ends = []
        for s in (stream, behind):
            outs = [out async for batch in s for out in batch]
            ends.append(outs[-1].finish_reason)
        return cut, computed, waiting, unknown, ends

    try:
        cut, computed, waiting, unknown, ends = asyncio.run(scenario())
    finally:
        llm.shutdown()
    assert waiting == AbortReport(0, 0, 0)
    assert cut is not None and cut.num_output_tokens == 0 and cut.num_cached_tokens == 0
    # Exactly the tokens the engine ran for it (a step in flight at the abort included).
    assert 160 <= cut.num_prompt_tokens == computed < len(prompt)
    assert unknown is None
    assert ends == ["abort", "abort"]
