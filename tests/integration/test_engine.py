"""The engine end to end on the embedded model: correctness against transformers and the
scheduling behaviours (batching, prefix cache, preemption, seeds, stops)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch

from tokenyard.bench.reference import greedy_continuation
from tokenyard.engine.async_llm import AsyncLLM
from tokenyard.engine.frontend import make_request
from tokenyard.engine.llm import LLM
from tokenyard.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
]


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def prompt_ids(llm: LLM) -> list[list[int]]:
    return [llm.frontend.prompt_token_ids(c) for c in CHATS]


def test_greedy_continuations_equal_transformers(llm: LLM, hf_model: Any) -> None:
    ours = llm.generate(prompt_ids(llm), greedy(32))
    for ids, result in zip(prompt_ids(llm), ours, strict=True):
        assert result.token_ids == greedy_continuation(hf_model, ids, 32)


def test_paged_logprobs_match_transformers_logits(llm: LLM, hf_model: Any) -> None:
    """Logits through the paged KV path (prefill then 3 decode steps) agree within 1e-3."""
    for ids in prompt_ids(llm):
        result = llm.generate([ids], greedy(4, logprobs=5))[0]
        full = torch.tensor([ids + result.token_ids[:-1]])
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(full).logits[0, len(ids) - 1:].float(), dim=-1)
        assert result.completions[0].logprobs is not None
        for step, lp in enumerate(result.completions[0].logprobs):
            for token_id, value in [(lp.token_id, lp.logprob), *lp.top]:
                expected = float(ref[step, token_id])
                assert abs(value - expected) <= 1e-3 * max(1.0, abs(expected))


def test_greedy_output_is_the_same_alone_and_in_a_batch_of_16(llm: LLM) -> None:
    rng = random.Random(5)
    target = prompt_ids(llm)[1]
    others = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 300))] for _ in range(15)]
    alone = llm.generate([target], greedy(32))[0].token_ids
    batch = llm.generate([*others[:7], target, *others[7:]], greedy(32))
    assert batch[7].token_ids == alone


def test_shared_prefix_computes_only_the_suffix_and_matches_uncached(llm: LLM) -> None:
    rng = random.Random(9)
    prefix = [rng.randrange(100, 40000) for _ in range(500)]
    first = [*prefix, 11, 12, 13]
    second = [*prefix, 21, 22, 23, 24]
    llm.core.kv.pool.reset_prefix_cache()
    llm.generate([first], greedy(8))
    before = llm.core.stats().num_computed_tokens
    cached = llm.generate([second], greedy(8))[0]
    computed = llm.core.stats().num_computed_tokens - before
    assert cached.num_cached_tokens == 496  # 31 full blocks of 16
    assert computed == len(second) - 496 + 7  # the suffix, then 7 decode steps
    llm.core.kv.pool.reset_prefix_cache()
    uncached = llm.generate([second], greedy(8))[0]
    assert uncached.num_cached_tokens == 0
    assert uncached.token_ids == cached.token_ids


# Shorter: tests/unit/test_scheduler.py's preempted requests end with their greedy tokens.
@pytest.mark.long
def test_preemption_under_a_small_pool_gives_the_same_outputs_and_frees_all_blocks(
    llm: LLM,
) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(20, 60))] for _ in range(8)]
    expected = [r.token_ids for r in llm.generate(prompts, greedy(40))]
    small = LLM(weights="float32", num_kv_blocks=24, enable_prefix_caching=False)
    got = [r.token_ids for r in small.generate(prompts, greedy(40))]
    stats = small.core.stats()
    assert stats.num_preemptions > 0
    assert got == expected
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert all(block.ref_cnt == 0 for block in small.core.kv.pool.blocks)


# Shorter: tests/e2e/test_async_scheduling.py serves with async scheduling and compares.
@pytest.mark.long
def test_async_scheduling_gives_the_step_by_step_outputs_and_overlaps_steps(
    llm: LLM,
) -> None:
    """Planning each step while the one before computes changes no output: greedy,
    seeded, EOS, stop token, min_tokens and penalties (the last two turn the overlap off
    while they run), and with preemption in a small pool; every block is free after."""
    rng = random.Random(11)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(20, 60))] for _ in range(8)]
    convo = prompt_ids(llm)[0]
    natural = llm.generate([convo], SamplingParams(temperature=0.0, max_tokens=200))[0]
    mixed = [
        SamplingParams(temperature=0.0, max_tokens=200),
        SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[natural.token_ids[1]]),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=len(natural.token_ids) + 3,
                       min_tokens=len(natural.token_ids) + 3),
    ]
    plain = [greedy(40 + i) for i in range(8)]
    expected_plain = [r.token_ids for r in llm.generate(prompts, plain)]
    expected_mixed = [r.token_ids for r in llm.generate([convo] * 5, mixed)]

    engine = LLM(weights="float32", async_scheduling=True)
    assert [r.token_ids for r in engine.generate(prompts, plain)] == expected_plain
    overlapped = engine.core.stats().num_overlapped_steps
    assert overlapped >= 40  # every step after the first prefill, about
    assert [r.token_ids for r in engine.generate([convo] * 5, mixed)] == expected_mixed
    penalized = engine.core.stats().num_overlapped_steps
    engine.generate([convo], mixed[3])
    assert engine.core.stats().num_overlapped_steps == penalized  # penalties: no overlap
    stats = engine.core.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    engine.core.close()

    small = LLM(weights="float32", async_scheduling=True, num_kv_blocks=24,
                enable_prefix_caching=False)
    assert [r.token_ids for r in small.generate(prompts, plain)] == expected_plain
    stats = small.core.stats()
    assert stats.num_preemptions > 0 and stats.num_overlapped_steps > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert all(block.ref_cnt == 0 for block in small.core.kv.pool.blocks)
    small.core.close()


def test_seed_gives_the_same_sample_whatever_the_batch(llm: LLM) -> None:
    target = prompt_ids(llm)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([target], seeded)[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    others = [[500 + i] * (3 + 7 * i) for i in range(5)]
    mixed = llm.generate([*others, target], [noise] * 5 + [seeded])
    assert mixed[-1].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=24, ignore_eos=True)
    assert llm.generate([target], other_seed)[0].token_ids != alone


def test_n_completions_are_independent_and_reproducible(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    first = llm.generate(CHATS[0], params)[0]
    again = llm.generate(CHATS[0], params)[0]
    assert [c.token_ids for c in first.completions] == [c.token_ids for c in again.completions]
    assert len({tuple(c.token_ids) for c in first.completions}) == 3


def test_stop_string_split_across_tokens_is_never_emitted(llm: LLM) -> None:
    ids = prompt_ids(llm)[1]
    full = llm.generate([ids], greedy(40))[0]
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    # A stop string made of the end of one token and the start of the next.
    i = next(i for i in range(3, len(pieces) - 1)
             if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    result = llm.generate([ids], greedy(40, stop=[stop]))[0].completions[0]
    assert stop not in result.text
    assert result.text == full.text[: full.text.index(stop)]
    assert result.finish_reason == "stop"
    assert result.stop_reason == stop


def test_finish_reasons_for_eos_length_stop_token_and_min_tokens(llm: LLM) -> None:
    convo = CHATS[0]
    natural = llm.generate(convo, SamplingParams(temperature=0.0, max_tokens=200))[0]
    assert natural.completions[0].finish_reason == "stop"
    assert natural.completions[0].stop_reason is None  # EOS
    n_natural = len(natural.token_ids)
    capped = llm.generate(convo, SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert capped.completions[0].finish_reason == "length" and len(capped.token_ids) == 3
    stop_tok = natural.token_ids[1]
    by_token = llm.generate(
        convo, SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[stop_tok])
    )[0].completions[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == stop_tok
    assert by_token.token_ids == natural.token_ids[:2]
    longer = llm.generate(
        convo, SamplingParams(temperature=0.0, max_tokens=n_natural + 5, min_tokens=n_natural + 5)
    )[0]
    assert len(longer.token_ids) == n_natural + 5
    # EOS cannot be sampled before min_tokens, so none hides inside the output.
    assert not set(longer.token_ids[:-1]) & set(llm.tokenizer.eos_token_ids)


def test_async_consumer_that_stops_iterating_aborts_and_frees_blocks() -> None:
    engine = AsyncLLM()

    async def scenario() -> list[str]:
        texts: list[str] = []
        params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        stream = engine.generate("Tell me a long story.", params, "r1")
        async for out in stream:
            texts.append(out.deltas[0].text)
            if len(texts) == 3:
                break
        await stream.aclose()
        for _ in range(200):
            stats = engine.stats()
            if stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks:
                break
            await asyncio.sleep(0.01)
        return texts

    try:
        texts = asyncio.run(scenario())
        stats = engine.stats()
        assert len(texts) == 3
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
    finally:
        engine.shutdown()


def test_a_consumer_behind_the_engine_takes_the_queued_steps_in_order_from_ready(
    llm: LLM,
) -> None:
    """What the replica's writer does: every step that arrived while it was busy goes out
    with the one it holds, in order, and the stream still ends after the last."""
    engine = AsyncLLM()
    ids = prompt_ids(llm)[0]

    async def scenario() -> tuple[list[int], list[int]]:
        request = make_request("r", ids, greedy(12), engine.engine.eos_token_ids)
        tokens: list[int] = []
        sizes: list[int] = []
        async with await engine.engine.submit([request]) as stream:
            async for batch in stream:
                await asyncio.sleep(0.3)  # the engine steps on meanwhile
                batch = batch + stream.ready()
                sizes.append(len(batch))
                tokens += [t for out in batch for t in out.new_token_ids]
        return tokens, sizes

    try:
        tokens, sizes = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert tokens == llm.generate([ids], greedy(12))[0].token_ids
    assert max(sizes) > 1 and sum(sizes) == 12


def test_request_longer_than_the_context_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="context window"):
        llm.generate([[5] * 9000], greedy(4))


def test_default_weights_serve_the_embedded_gguf_q4_1_blocks(llm: LLM) -> None:
    from tokenyard.engine.kernels.blocks import kernel_available

    if not kernel_available():
        pytest.skip("the quant_matmul kernel is unavailable here (auto serves float32)")
    default = LLM()
    assert default.frontend.weights == "q4_1" and llm.frontend.weights == "float32"
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # Within 0.04 % of float32's top-1 tokens: a short greedy answer is the same.
    expected = llm.generate(prompt, params)[0].token_ids
    assert default.generate(prompt, params)[0].token_ids == expected
