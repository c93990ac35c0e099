"""Prompt logprobs (`SamplingParams.prompt_logprobs`, the legacy completions' `echo` with
`logprobs`) in the engine on the embedded model: every prefill row scored against
transformers' logits, across prefill chunks, in a preempting pool and async scheduling,
unchanged by the prefix cache, every block free after."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tokenyard.engine.llm import LLM
from tokenyard.engine.sample.prompt_logprobs import join_scores, prompt_span
from tokenyard.wire.outputs import PromptLogprobs, TokenLogprobs
from tokenyard.wire.sampling_params import SamplingParams, SamplingParamsError

pytestmark = pytest.mark.slow

TOP = 3


def scored(n: int = 1, top: int = TOP) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, prompt_logprobs=top)


def prompt_scores(llm: LLM, prompts: list[list[int]], n: int = 1) -> list[PromptLogprobs]:
    out = []
    for result in llm.generate(prompts, scored(n)):
        got = result.completions[0].prompt_logprobs
        assert got is not None
        out.append(got)
    return out


def random_prompts(seed: int, count: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(low, high))]
            for _ in range(count)]


def assert_close(a: PromptLogprobs, b: PromptLogprobs, tol: float = 1e-4) -> None:
    assert a.token_ids == b.token_ids and len(a.entries) == len(b.entries)
    for x, y in zip(a.entries, b.entries, strict=True):
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= tol
        assert [t for t, _ in x.top] == [t for t, _ in y.top] or all(
            abs(u - v) <= tol for (_, u), (_, v) in zip(x.top, y.top, strict=True))


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.core.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert all(block.ref_cnt == 0 for block in llm.core.kv.pool.blocks)


def test_every_prompt_token_is_scored_as_transformers_scores_it(llm: LLM, hf_model: Any) -> None:
    prompt = llm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    got = prompt_scores(llm, [prompt])[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert got.token_ids == prompt and len(got.entries) == len(prompt) - 1
    for position, entry in enumerate(got.entries):
        assert entry.token_id == prompt[position + 1]
        expected = float(ref[position, entry.token_id])
        assert abs(entry.logprob - expected) <= 1e-3 * max(1.0, abs(expected))
        best = ref[position].topk(TOP)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        for (_, value), want in zip(entry.top, best.values.tolist(), strict=True):
            assert abs(value - want) <= 1e-3 * max(1.0, abs(want))
    assert_all_blocks_free(llm)


def test_the_prefix_cache_neither_feeds_nor_changes_the_scores(llm: LLM) -> None:
    """A cached prompt is computed again to be scored (the same scores, no cache hit),
    while a request without prompt logprobs still reads the cache."""
    prompt = random_prompts(21, 1, 100, 100)[0]
    llm.core.kv.pool.reset_prefix_cache()
    first = llm.generate([prompt], scored())[0]
    again = llm.generate([prompt], scored())[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 0
    assert first.completions[0].prompt_logprobs == again.completions[0].prompt_logprobs
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert plain.num_cached_tokens == 96  # 6 full blocks of 16
    assert plain.completions[0].prompt_logprobs is None
    assert_all_blocks_free(llm)


def test_chunks_preemption_and_async_scheduling_give_the_same_scores(llm: LLM) -> None:
    prompts = random_prompts(8, 6, 40, 90)
    expected = prompt_scores(llm, prompts, n=4)
    # 32 tokens a step: each prompt is scored over 2 to 3 steps; 10 blocks for 6 prompts
    # of 40 to 90 tokens: requests are preempted and recomputed.
    engine = LLM(weights="float32", max_num_batched_tokens=32, num_kv_blocks=10,
                 enable_prefix_caching=False, async_scheduling=True)
    got = prompt_scores(engine, prompts, n=4)
    got += prompt_scores(engine, prompts, n=0)  # scored alone, nothing generated
    for a, b in zip(got, expected * 2, strict=True):
        assert_close(a, b)
    stats = engine.core.stats()
    assert stats.num_preemptions > 0 and stats.num_overlapped_steps > 0
    assert_all_blocks_free(engine)
    engine.core.close()


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(llm: LLM) -> None:
    prompts = random_prompts(4, 3, 5, 40)
    alone = llm.generate(prompts, scored(0))
    with_a_token = prompt_scores(llm, prompts)
    for result, expected in zip(alone, with_a_token, strict=True):
        (completion,) = result.completions
        assert (completion.token_ids, completion.text) == ([], "")
        assert completion.finish_reason == "length"
        assert completion.prompt_logprobs == expected
    assert_all_blocks_free(llm)
    with pytest.raises(SamplingParamsError) as err:  # nothing to do without the scores
        SamplingParams(max_tokens=0)
    assert err.value.param == "max_tokens"


def test_a_one_token_prompt_has_nothing_to_score_and_top_zero_no_alternatives(
    llm: LLM,
) -> None:
    one = prompt_scores(llm, [[1234]])[0]
    assert one == PromptLogprobs([1234], [])
    bare = llm.generate([[100, 200, 300]], scored(top=0))[0].completions[0].prompt_logprobs
    assert bare is not None and [e.top for e in bare.entries] == [[], []]
    assert all(e.logprob <= 0.0 for e in bare.entries)
    with pytest.raises(SamplingParamsError):
        SamplingParams(prompt_logprobs=21)


def test_spans_and_joins_score_each_position_once() -> None:
    prompt = [5, 6, 7, 8, 9]
    # A chunk of positions 2..4 (rows 10..12) scores positions 2 and 3 (4 is the last).
    span = prompt_span("r", prompt, 2, row=10, start=2, num_rows=3, num_scored=0)
    assert span is not None and (span.row, span.first, span.targets) == (10, 2, [8, 9])
    # Positions already scored (a recompute after preemption) are not scored again.
    span = prompt_span("r", prompt, 2, row=0, start=0, num_rows=5, num_scored=3)
    assert span is not None and (span.row, span.first, span.targets) == (3, 3, [9])
    assert prompt_span("r", prompt, 2, row=0, start=0, num_rows=5, num_scored=4) is None
    assert prompt_span("r", prompt, None, row=0, start=0, num_rows=5, num_scored=0) is None
    have = [TokenLogprobs(-1.0, []), TokenLogprobs(-2.0, [])]
    join_scores(have, 1, [TokenLogprobs(-9.0, []), TokenLogprobs(-3.0, [])])
    assert [e.logprob for e in have] == [-1.0, -2.0, -3.0]
    join_scores(have, 5, [TokenLogprobs(-5.0, [])])  # a gap: not joined
    assert len(have) == 3
