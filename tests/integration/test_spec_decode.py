"""n-gram speculative decoding in the engine (issue 39 part 3): greedy output is token for
token what decoding without it gives, on the embedded model, for a reply that copies its
prompt and one that does not; a step mixes speculating rows and rows that cannot (logprobs,
penalties); and sampled output keeps the target's distribution (two-sample chi-square of
three sampled tokens of a small random model, with and without drafts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from scipy.stats import chi2_contingency

from tests.unit.test_family_engine_parity import _TINY, _byte_tokenizer
from tests.unit.test_model_parity import _randomize
from tokenyard.engine.llm import LLM
from tokenyard.wire.sampling_params import SamplingParams

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'
TEXT = ("Paged attention stores the KV cache in fixed-size blocks, so no memory is lost to "
        "padding, and requests with the same prefix share blocks. Continuous batching lets "
        "a new request join the running batch at every step.")
COPY = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]
FREE = [{"role": "user", "content": "Name three rivers of Europe."}]


@pytest.fixture(scope="module")
def engines() -> dict[bool, LLM]:
    return {spec: LLM(speculative_config=SPEC if spec else None, max_num_seqs=8)
            for spec in (False, True)}


def _tokens(llm: LLM, prompts: list[Any], params: list[SamplingParams]) -> list[list[int]]:
    return [r.completions[0].token_ids for r in llm.generate(prompts, params)]


def test_greedy_output_is_unchanged_and_drafts_are_accepted(engines: dict[bool, LLM]) -> None:
    greedy = SamplingParams(max_tokens=60, temperature=0.0)
    plain = _tokens(engines[False], [COPY, FREE], [greedy, greedy])
    spec = engines[True]
    before = spec.core.scheduler.speculator
    assert before is not None
    drafted = _tokens(spec, [COPY, FREE], [greedy, greedy])
    assert drafted == plain
    assert before.num_accepted > 20, (before.num_drafts, before.num_accepted)
    # Fewer verified steps than tokens: the copy took more than one token a step.
    assert before.num_steps < sum(len(t) for t in drafted)


def test_a_step_mixes_speculating_rows_and_rows_that_cannot(engines: dict[bool, LLM]) -> None:
    """Logprobs and penalties sample one position at a time: those rows never draft, and
    share steps with a row that does; every row's greedy output is unchanged."""
    params = [SamplingParams(max_tokens=40, temperature=0.0),
              SamplingParams(max_tokens=40, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.2)]
    prompts = [COPY, COPY, COPY]
    plain = engines[False].generate(prompts, params)
    spec = engines[True]
    speculator = spec.core.scheduler.speculator
    assert speculator is not None
    accepted = speculator.num_accepted
    drafted = spec.generate(prompts, params)
    assert [r.completions[0].token_ids for r in drafted] == [
        r.completions[0].token_ids for r in plain]
    assert speculator.num_accepted > accepted
    logprobs = drafted[1].completions[0].logprobs
    assert logprobs is not None and len(logprobs) == len(drafted[1].completions[0].token_ids)


def test_stops_and_lengths_cut_inside_an_accepted_run(engines: dict[bool, LLM]) -> None:
    """max_tokens and stop tokens end the reply where decoding alone would, even when the
    step verified drafts past them."""
    for cap in (1, 2, 7, 13):
        params = SamplingParams(max_tokens=cap, temperature=0.0)
        plain = _tokens(engines[False], [COPY], [params])
        assert _tokens(engines[True], [COPY], [params]) == plain and len(plain[0]) == cap
    full = _tokens(engines[False], [COPY], [SamplingParams(max_tokens=30, temperature=0.0)])[0]
    stop = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[full[9]])
    assert _tokens(engines[True], [COPY], [stop]) == _tokens(engines[False], [COPY], [stop])


# ------------------------------------------------------------------ distribution kept

PATTERN = [40, 41, 42, 43] * 4
#: Favour the pattern's tokens so that drafts are accepted often, but not always.
BIAS = {t: 3.0 for t in (40, 41, 42, 43)}


def save_tiny_model(folder: Path) -> Path:
    """A small random Llama with a byte-level vocabulary, as a Hugging Face folder."""
    config = transformers.LlamaConfig(**_TINY)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    _randomize(model)
    model.save_pretrained(folder)
    _byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-spec"))


def _replies(llm: LLM, count: int,
             params: SamplingParams | None = None) -> list[tuple[int, ...]]:
    """Three sampled tokens each: the first comes from the prefill, the next two from a
    decode step that verifies one draft (the most `max_tokens` leaves room for)."""
    params = params or SamplingParams(max_tokens=3, temperature=1.0, top_k=3,
                                      logit_bias=BIAS, ignore_eos=True)
    results = llm.generate([PATTERN] * count, params)
    return [tuple(r.completions[0].token_ids) for r in results]


def test_sampled_output_keeps_the_target_distribution(tiny_model: Path) -> None:
    count = 2000
    kwargs: dict[str, Any] = {"weights": "float32", "device": "cpu", "max_num_seqs": 256,
                              "max_waiting_requests": 4096}
    plain = _replies(LLM(str(tiny_model), **kwargs), count)
    spec_llm = LLM(str(tiny_model), speculative_config=SPEC, **kwargs)
    drafted = _replies(spec_llm, count)
    speculator = spec_llm.core.scheduler.speculator
    assert speculator is not None
    # Both paths of the rule ran: drafts kept, and drafts replaced by the target's token.
    assert 0 < speculator.num_accepted < speculator.num_drafts, (
        speculator.num_accepted, speculator.num_drafts)
    p_value = same_distribution_p(plain, drafted)
    assert p_value > 1e-3, p_value


def same_distribution_p(plain: list[tuple[int, ...]], drafted: list[tuple[int, ...]]) -> float:
    """Two-sample chi-square p-value of two samples of replies (cells seen fewer than 20
    times in both together are pooled into one)."""
    cells = sorted(set(plain) | set(drafted))
    table = [[sum(1 for x in arm if x == cell) for cell in cells] for arm in (plain, drafted)]
    common = [i for i in range(len(cells)) if table[0][i] + table[1][i] >= 20]
    rest = [sum(row) - sum(row[i] for i in common) for row in table]
    observed = [[row[i] for i in common] + ([left] if any(rest) else [])
                for row, left in zip(table, rest, strict=True)]
    return float(chi2_contingency(observed)[1])
