"""Draft-model speculative decoding (engine/spec/draft.py, issue 39 part 3) on real models:
greedy output is token for token what decoding without drafts gives, with the embedded
model drafting for itself (nearly every draft kept) and with a random 2-layer Llama of its
vocabulary (most drafts rejected: the draft's KV is rolled back, and the pacer stops it),
in steps that mix speculating rows and rows that cannot (logprobs); after rollbacks the
draft still proposes what the model decodes from scratch; sampled output keeps
the target's distribution (seeded two-sample chi-square); the draft's KV blocks all come
back when requests finish, are aborted or preempted; a draft of another vocabulary is
refused when the engine is built."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import transformers

from tests.integration.test_spec_decode import (
    COPY,
    FREE,
    _replies,
    _tokens,
    same_distribution_p,
    save_tiny_model,
)
from tokenyard.engine.llm import LLM
from tokenyard.engine.request import Request
from tokenyard.engine.spec.draft import DraftProposer
from tokenyard.engine.spec.speculator import Speculator
from tokenyard.wire.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0.0)
#: Logprobs sample one position a step: this row never drafts, and shares steps with those
#: that do.
MIXED = [GREEDY, GREEDY, SamplingParams(max_tokens=32, temperature=0.0, logprobs=2)]
LIST = [{"role": "user", "content": "List the planets of the solar system, one a line."}]
PROMPTS = [COPY, FREE, LIST]


def draft_spec(model: Path | str, k: int = 4) -> str:
    return json.dumps({"method": "draft_model", "model": str(model),
                       "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(max_num_seqs=8)


@pytest.fixture(scope="module")
def expected(plain: LLM) -> list[list[int]]:
    """The greedy replies to PROMPTS without drafts."""
    return _tokens(plain, PROMPTS, MIXED)


@pytest.fixture(scope="module")
def self_drafting(embedded_gguf_path: Path) -> LLM:
    """The embedded model drafting for itself."""
    return LLM(speculative_config=draft_spec(embedded_gguf_path), max_num_seqs=8)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory: pytest.TempPathFactory, plain: LLM) -> Path:
    """A random Llama (2 layers, width 64) over the embedded model's vocabulary, saved with
    its tokenizer as a Hugging Face folder."""
    config = transformers.LlamaConfig(
        vocab_size=plain.frontend.model_config.vocab_size, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("random-draft")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    plain.tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


def _speculator(llm: LLM) -> tuple[Speculator, DraftProposer]:
    speculator = llm.core.scheduler.speculator
    assert speculator is not None and speculator.draft is not None
    return speculator, speculator.draft


def _assert_draft_kv_free(llm: LLM) -> None:
    _, draft = _speculator(llm)
    assert draft.num_requests == 0
    assert not draft.kv.block_tables
    assert draft.kv.pool.num_free_blocks == draft.kv.num_blocks


def test_the_model_drafting_for_itself_keeps_greedy_output(
        expected: list[list[int]], self_drafting: LLM) -> None:
    speculator, _ = _speculator(self_drafting)
    before = speculator.num_drafts, speculator.num_accepted, speculator.num_steps
    assert _tokens(self_drafting, PROMPTS, MIXED) == expected
    drafts, accepted, steps = (speculator.num_drafts - before[0],
                               speculator.num_accepted - before[1],
                               speculator.num_steps - before[2])
    assert accepted >= 0.9 * drafts > 0, (accepted, drafts)
    # More than one token a step for the two rows that speculate.
    assert steps < sum(len(t) for t in expected[:2]) / 2
    _assert_draft_kv_free(self_drafting)


def test_a_draft_that_disagrees_is_rolled_back_and_paced_off(
        expected: list[list[int]], random_draft: Path) -> None:
    llm = LLM(speculative_config=draft_spec(random_draft, k=3), max_num_seqs=8)
    assert _tokens(llm, PROMPTS, MIXED) == expected
    speculator, _ = _speculator(llm)
    assert speculator.num_drafts > 0 and speculator.num_accepted < speculator.num_drafts / 2
    # The pacer turned drafting off for most steps of the two rows that could draft.
    assert speculator.num_steps < sum(len(t) for t in expected[:2]) / 2
    _assert_draft_kv_free(llm)


def test_after_a_rollback_the_draft_proposes_what_a_fresh_one_would(
        plain: LLM, self_drafting: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled replies reject drafts now and then; each proposal after a rollback is the
    greedy continuation of the request's tokens so far, as the same model decodes it from
    scratch: no KV of a rejected draft is read."""
    speculator, draft = _speculator(self_drafting)
    rejected_before = speculator.num_drafts - speculator.num_accepted
    seen: list[tuple[list[int], list[int]]] = []  # (the request's tokens, its drafts)
    propose = draft.propose

    def recording(wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        out = propose(wanted)
        seen.extend((list(r.all_token_ids), out[r.request_id])
                    for r, _ in wanted if r.request_id in out)
        return out

    monkeypatch.setattr(draft, "propose", recording)
    _tokens(self_drafting, [FREE], [SamplingParams(max_tokens=24, temperature=1.0, seed=7)])
    # The proposals that follow a rejected draft (one request: consecutive entries).
    after = [(tokens, drafts) for (before, rejected), (tokens, drafts) in pairwise(seen)
             if tokens[len(before):len(before) + len(rejected)] != rejected]
    assert after and speculator.num_drafts - speculator.num_accepted > rejected_before
    fresh = plain.generate([tokens for tokens, _ in after], [
        SamplingParams(max_tokens=len(drafts), temperature=0.0, ignore_eos=True)
        for _, drafts in after])
    assert [r.completions[0].token_ids for r in fresh] == [drafts for _, drafts in after]


def test_draft_kv_comes_back_after_abort_and_preemption(
        plain: LLM, embedded_gguf_path: Path) -> None:
    # A pool too small for all four replies at once: requests are preempted and resumed.
    prompts = [*PROMPTS, [{"role": "user", "content": "Count from one to thirty."}]]
    params = [GREEDY] * len(prompts)
    expected = _tokens(plain, prompts, params)
    llm = LLM(speculative_config=draft_spec(embedded_gguf_path), max_num_seqs=8,
              num_kv_blocks=16, async_scheduling=True)
    frontend = llm.frontend
    frontend.add_request("gone", frontend.prompt_token_ids(COPY),
                         SamplingParams(max_tokens=100, temperature=0.0))
    _, draft = _speculator(llm)
    while not draft.kv.block_tables:
        frontend.step()
    frontend.abort("gone")
    _assert_draft_kv_free(llm)
    while frontend.has_work:
        frontend.step()
    assert _tokens(llm, prompts, params) == expected
    assert llm.core.scheduler.num_preemptions > 0
    _assert_draft_kv_free(llm)


def test_sampled_output_keeps_the_target_distribution(tmp_path: Path) -> None:
    """The tiny model drafts for itself: its argmax is one of the top 3 the target samples
    from, kept about as often as the target samples it; both arms are seeded."""
    folder = save_tiny_model(tmp_path)
    kwargs = {"weights": "float32", "device": "cpu", "max_num_seqs": 256,
              "max_waiting_requests": 4096}
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    count = 1000
    torch.manual_seed(1)
    plain = _replies(LLM(str(folder), **kwargs), count, params)
    llm = LLM(str(folder), speculative_config=draft_spec(folder, k=2), **kwargs)
    torch.manual_seed(2)
    drafted = _replies(llm, count, params)
    speculator, _ = _speculator(llm)
    assert 0 < speculator.num_accepted < speculator.num_drafts, (
        speculator.num_accepted, speculator.num_drafts)
    assert same_distribution_p(plain, drafted) > 1e-3
    _assert_draft_kv_free(llm)


def test_a_draft_of_another_vocabulary_is_refused(tmp_path: Path) -> None:
    folder = save_tiny_model(tmp_path)
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        LLM(speculative_config=draft_spec(folder))
