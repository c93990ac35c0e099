"""The batched sampler: greedy, filters, penalties, bias, seeds, logprobs, distributions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import pytest
import torch

from tokenyard.engine.sample import Sampler, SamplingBatch, make_generator
from tokenyard.engine.sample.filters import argmax, top_candidates
from tokenyard.wire.sampling_params import SamplingParams

SAMPLER = Sampler()


def make_batch(
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> SamplingBatch:
    return SamplingBatch.from_params(params, generators, prompts, outputs)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    return SAMPLER(logits, make_batch(params, generators, prompts, outputs)).token_ids


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    """Pearson's statistic of `tokens` against `probs` [V] (bins with p > 0)."""
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


# Upper 0.1% points of chi-square, by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 7: 24.32}


def distinct_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows of logits whose values are all at least 0.1 apart (no near-ties)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=gen).float() * 0.1 for _ in range(rows)])


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_ties_go_to_lowest_id() -> None:
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0))
    logits[3, [17, 40, 900]] = 50.0  # a three-way tie
    tokens = sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[3] == 17


def test_blocked_argmax_matches_torch_including_ties() -> None:
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(5, 64 * 50, generator=gen)
    logits[1] = torch.randint(0, 3, (64 * 50,), generator=gen).float()  # ties everywhere
    logits[2, [100, 3000, 65]] = 20.0  # tie across blocks: lowest id wins
    logits[3, [70, 71]] = 20.0  # tie inside a block
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    assert argmax(logits)[2:4].tolist() == [65, 70]
    tokens = sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_near_zero_temperature_matches_greedy() -> None:
    logits = distinct_logits(16, 500, seed=1)
    torch.manual_seed(0)
    for _ in range(3):
        tokens = sample(logits, [SamplingParams(temperature=1e-3)] * 16)
        assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_one_and_tiny_top_p_match_greedy() -> None:
    logits = distinct_logits(12, 3000, seed=2)
    greedy = logits.argmax(dim=-1).tolist()
    torch.manual_seed(0)
    for params in (SamplingParams(temperature=1.5, top_k=1),
                   SamplingParams(temperature=1.5, top_p=1e-6)):
        for _ in range(3):
            assert sample(logits, [params] * 12) == greedy


def test_mixed_greedy_and_random_rows() -> None:
    logits = distinct_logits(6, 300, seed=3)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, top_k=1) for i in range(6)]
    batch = make_batch(params)
    assert not batch.all_greedy and not batch.all_random
    assert SAMPLER(logits, batch).token_ids == logits.argmax(dim=-1).tolist()


# --------------------------------------------------------------------------- filters


def test_min_p_drops_tokens_below_fraction_of_the_best() -> None:
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log().expand(6000, -1).contiguous()
    params = [SamplingParams(temperature=1.0, min_p=0.15)] * 6000  # keeps p >= 0.075
    assert SAMPLER.kept_token_ids(logits[:1], make_batch(params[:1])) == [[0, 1, 2]]
    torch.manual_seed(1234)
    tokens = sample(logits, params)
    kept = torch.tensor([0.5, 0.3, 0.1, 0.0, 0.0]) / 0.9
    assert chi_square(tokens, kept) < CHI2_999[2]


def test_min_p_with_seeded_generator_over_many_steps() -> None:
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    logits = probs.log().unsqueeze(0)
    gen = make_generator(7)
    batch = make_batch([SamplingParams(temperature=1.0, min_p=0.3, seed=7)], [gen])
    tokens = [SAMPLER(logits, batch).token_ids[0] for _ in range(3000)]
    kept = torch.tensor([0.4, 0.25, 0.2, 0.0, 0.0]) / 0.85
    assert chi_square(tokens, kept) < CHI2_999[2]


def test_top_k_and_top_p_distributions() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
    logits = probs.log().expand(8000, -1).contiguous()
    torch.manual_seed(99)
    # top_p 0.75: 0.4 and 0.4+0.3 are below it, so the first three survive.
    tokens = sample(logits, [SamplingParams(temperature=1.0, top_p=0.75)] * 8000)
    assert chi_square(tokens, torch.tensor([0.4, 0.3, 0.2, 0, 0]) / 0.9) < CHI2_999[2]
    # top_k 2, then top_p renormalised over those two: 0.4/0.7 = 0.57 < 0.6 keeps both.
    tokens = sample(logits, [SamplingParams(temperature=1.0, top_k=2, top_p=0.6)] * 8000)
    assert chi_square(tokens, torch.tensor([0.4, 0.3, 0, 0, 0]) / 0.7) < CHI2_999[1]
    # top_k 2 with top_p 0.55: 0.4/0.7 = 0.57 >= 0.55, so only the best survives.
    tokens = sample(logits[:100], [SamplingParams(temperature=1.0, top_k=2, top_p=0.55)] * 100)
    assert set(tokens) == {0}


def reference_kept(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """Sort-based reference of top-k -> top-p -> min-p for one row [V]."""
    scaled = logits.double() / temperature
    order = scaled.argsort(descending=True)
    values = scaled[order]
    if 0 < top_k < values.numel():
        order, values = order[:top_k], values[:top_k]
    probs = torch.softmax(values, dim=0)
    before = probs.cumsum(0) - probs
    n = int((before < top_p).sum()) if top_p < 1.0 else values.numel()
    order, probs = order[:n], probs[:n]
    if min_p > 0:
        order = order[probs >= min_p * probs[0]]
    return set(order.tolist())


@pytest.mark.parametrize("vocab", [6000, 16384])
@pytest.mark.parametrize("scale", [0.3, 2.0, 8.0])
def test_kept_sets_match_sort_reference(scale: float, vocab: int) -> None:
    # Flat logits (scale 0.3) force the full-sort fallback; peaky ones settle early.
    # 16384 = 256 blocks of 64 takes the block pre-selection path at the first level.
    gen = torch.Generator().manual_seed(int(scale * 10) + vocab)
    logits = torch.randn(8, vocab, generator=gen) * scale
    settings = [(1.0, 0, 0.9, 0.0), (0.7, 0, 0.5, 0.0), (1.3, 40, 1.0, 0.0),
                (1.0, 700, 0.95, 0.0), (1.0, 0, 1.0, 0.2), (0.8, 0, 0.8, 0.05),
                (1.0, 5000, 1.0, 0.0), (1.0, 3, 0.99, 0.3)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in settings]
    kept = SAMPLER.kept_token_ids(logits, make_batch(params))
    for row, (t, k, p, m) in enumerate(settings):
        got = kept[row]
        assert got is not None and got == sorted(got)
        want = reference_kept(logits[row], t, k, p, m)
        # Float rounding may move a top-p boundary by one token at most.
        assert len(set(got) ^ want) <= 1, (row, len(got), len(want))
    tokens = SAMPLER(logits, make_batch(params)).token_ids
    for row, token in enumerate(tokens):
        assert token in (kept[row] or [])


def test_block_preselected_candidates_equal_topk() -> None:
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(6, 64 * 300, generator=gen)
    logits[1] = torch.randint(0, 4, (64 * 300,), generator=gen).float()  # massive ties
    logits[2, :64] = 9.0  # all of the best values in one block
    values, ids = top_candidates(logits, 64)
    want = logits.topk(64, dim=-1).values
    assert torch.equal(values, want)
    assert torch.equal(logits.gather(1, ids), values)
    assert all(len(set(row)) == 64 for row in ids.tolist())


# --------------------------------------------------------------------------- penalties


def test_penalties_exact_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]])
    prompt, output = [[0, 1]], [[2, 2, 3]]

    def processed(rep: float = 1.0, freq: float = 0.0, pres: float = 0.0) -> list[float]:
        params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq,
                                presence_penalty=pres)
        batch = make_batch([params], None, prompt, output)
        return SAMPLER.process_logits(logits, batch)[0].tolist()

    # Repetition: tokens of prompt and output; positive / 2, negative * 2.
    assert processed(rep=2.0) == [1.0, -2.0, 0.25, -1.0, 1.0, 3.0]
    # Frequency: output counts only (token 2 twice, token 3 once); prompt ignored.
    assert processed(freq=0.5) == [2.0, -1.0, -0.5, -1.0, 1.0, 3.0]
    # Presence: once per distinct output token.
    assert processed(pres=0.25) == [2.0, -1.0, 0.25, -0.75, 1.0, 3.0]
    # All three: repetition first, then frequency and presence.
    assert processed(rep=2.0, freq=0.5, pres=0.25) == [1.0, -2.0, -1.0, -1.75, 1.0, 3.0]
    # Negative penalties encourage.
    assert processed(pres=-1.0)[2:4] == [1.5, 0.5]


def test_penalties_touch_only_their_rows_and_change_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.9, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.5),
              SamplingParams(temperature=0.0)]
    batch = make_batch(params, None, [[], []], [[0], [0]])
    out = SAMPLER.process_logits(logits, batch)
    assert torch.equal(out, torch.tensor([[0.5, 0.9, 0.0], [1.0, 0.9, 0.0]]))
    assert SAMPLER(logits, batch).token_ids == [1, 0]


def test_penalties_accept_tensor_rows_and_ignore_out_of_vocab_ids() -> None:
    logits = torch.zeros(1, 4)
    output = cast(Sequence[int], torch.tensor([1, 1, 9]))
    batch = make_batch([SamplingParams(presence_penalty=1.0)], None, [[]], [output])
    assert SAMPLER.process_logits(logits, batch).tolist() == [[0.0, -1.0, 0.0, 0.0]]


# --------------------------------------------------------------------------- logit bias


def test_logit_bias_bans_and_forces() -> None:
    logits = torch.zeros(200, 50)
    logits[:, 3] = 10.0
    torch.manual_seed(5)
    banned = sample(logits, [SamplingParams(temperature=1.0, logit_bias={3: -100.0})] * 200)
    assert 3 not in banned
    forced = sample(torch.zeros(200, 50),
                    [SamplingParams(temperature=1.0, logit_bias={7: 100.0})] * 200)
    assert set(forced) == {7}
    greedy = sample(logits[:1], [SamplingParams(temperature=0.0, logit_bias={3: -100.0})])
    assert greedy != [3]


def test_minus_inf_bias_set_by_the_runner_bans_a_token() -> None:
    logits = torch.tensor([[9.0, 1.0, 0.5, 0.0, -1.0]]).expand(300, -1).contiguous()
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                   SamplingParams(temperature=1.0, top_k=2, top_p=0.9)):
        batch = make_batch([params] * 300)
        batch.logit_bias = [{0: -math.inf}] * 300  # e.g. EOS before min_tokens
        torch.manual_seed(6)
        tokens = SAMPLER(logits, batch).token_ids
        assert 0 not in tokens and set(tokens) <= {1, 2, 3, 4}


def test_caller_logits_are_not_modified() -> None:
    logits = torch.randn(4, 700, generator=torch.Generator().manual_seed(4))
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, logit_bias={1: 5.0}, repetition_penalty=1.5),
        SamplingParams(temperature=0.9, top_p=0.8, presence_penalty=1.0),
        SamplingParams(temperature=1.1, top_k=10, min_p=0.1, logprobs=3),
        SamplingParams(temperature=0.7),
    ]
    SAMPLER(logits, make_batch(params, None, [[1, 2]] * 4, [[3, 4]] * 4))
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------- seeds


SEEDED_VARIANTS = [
    SamplingParams(temperature=1.0, seed=42),
    SamplingParams(temperature=0.8, top_p=0.9, seed=42),
    SamplingParams(temperature=1.2, top_k=20, min_p=0.02, seed=42),
]


def other_params(i: int) -> SamplingParams:
    kinds = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=5, seed=1000 + i),
        SamplingParams(temperature=1.5, seed=2000 + i),
        SamplingParams(temperature=0.9, min_p=0.1, top_p=0.99),
    ]
    return kinds[i % len(kinds)]


@pytest.mark.parametrize("variant", range(len(SEEDED_VARIANTS)))
def test_seed_gives_same_tokens_whatever_the_batch(variant: int) -> None:
    vocab, steps = 2000, 6
    gen = torch.Generator().manual_seed(11)
    row_logits = [torch.randn(vocab, generator=gen) * 1.5 for _ in range(steps)]
    seeded = SEEDED_VARIANTS[variant]

    def run(size: int, position: int) -> list[int]:
        params = [other_params(i) for i in range(size)]
        params[position] = seeded
        generators = [make_generator(p.seed) if p.seed is not None else None for p in params]
        got = []
        for step in range(steps):
            logits = torch.randn(size, vocab) * 3.0
            logits[position] = row_logits[step]
            got.append(sample(logits, params, generators)[position])
        return got

    torch.manual_seed(0)
    alone = run(1, 0)
    assert len(set(alone)) > 1  # genuinely random, not a constant
    for size, position in [(5, 0), (5, 3), (17, 8), (17, 16)]:
        torch.manual_seed(size * 100 + position)
        assert run(size, position) == alone, (size, position)


def test_different_seeds_give_different_samples() -> None:
    logits = torch.zeros(1, 1000)
    runs = []
    for seed in range(5):
        gen = make_generator(seed)
        batch = make_batch([SamplingParams(temperature=1.0, seed=seed)], [gen])
        runs.append(tuple(SAMPLER(logits, batch).token_ids[0] for _ in range(8)))
    assert len(set(runs)) == 5


def test_unseeded_rows_follow_global_rng() -> None:
    logits = torch.zeros(3, 1000)
    params = [SamplingParams(temperature=1.0)] * 3
    torch.manual_seed(3)
    first = sample(logits, params)
    torch.manual_seed(3)
    assert sample(logits, params) == first
    assert sample(logits, params) != first


# --------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("vocab", [300, 8192])
def test_logprobs_come_from_raw_logits(vocab: int) -> None:
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(8))
    params = [
        SamplingParams(temperature=0.5, top_p=0.7, logprobs=5, presence_penalty=2.0,
                       logit_bias={0: 30.0}),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=20, repetition_penalty=2.0),
    ]
    out = SAMPLER(logits, make_batch(params, None, [[5, 6]] * 4, [[7, 0]] * 4))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for row in (0, 1, 3):
        assert out.logprobs[row] == pytest.approx(raw[row, out.token_ids[row]].item(), abs=1e-5)
    assert math.isnan(out.logprobs[2])
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []
    for row, k in ((0, 5), (3, 20)):
        top = out.top_logprobs[row]
        assert len(top) == k
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        want = raw[row].topk(k)
        assert [t for t, _ in top] == want.indices.tolist()
        assert values == pytest.approx(want.values.tolist(), abs=1e-5)
    # Row 0's bias made token 0 the choice, yet its logprob is the raw one.
    assert out.token_ids[0] == 0


def test_no_logprobs_when_no_row_asks() -> None:
    out = SAMPLER(torch.randn(2, 10), make_batch([SamplingParams(temperature=0.0)] * 2))
    assert out.logprobs is None and out.top_logprobs is None


# --------------------------------------------------------------------------- distributions


def test_distribution_matches_tempered_softmax() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2])
    rows = 20000
    torch.manual_seed(2024)
    tokens = sample(logits.expand(rows, -1).contiguous(), [SamplingParams(temperature=0.7)] * rows)
    stat = chi_square(tokens, torch.softmax(logits / 0.7, dim=0))
    assert stat < CHI2_999[7]
    # The same draws are far from the untempered distribution.
    assert chi_square(tokens, torch.softmax(logits, dim=0)) > 100.0


def test_distribution_across_race_blocks_with_padded_vocab() -> None:
    # 600 ids = 3 blocks of 256, the last padded; mass on a few ids in different blocks.
    vocab, heavy = 600, [5, 255, 256, 300, 599]
    logits = torch.full((vocab,), -4.0)
    logits[heavy] = torch.tensor([1.0, 0.0, 0.5, 1.5, 0.8])
    probs = torch.softmax(logits, dim=0)
    rows = 12000
    torch.manual_seed(77)
    tokens = sample(logits.expand(rows, -1).contiguous(), [SamplingParams(temperature=1.0)] * rows)
    groups = torch.tensor([heavy.index(t) if t in heavy else len(heavy) for t in tokens])
    expected = torch.cat([probs[heavy], (1 - probs[heavy].sum()).reshape(1)])
    counts = torch.bincount(groups, minlength=len(heavy) + 1).double()
    stat = float(((counts - expected * rows) ** 2 / (expected * rows)).sum())
    assert stat < 20.52  # chi-square, 5 d.o.f., upper 0.1%


def test_seeded_row_distribution_matches_softmax() -> None:
    logits = torch.tensor([[0.3, -0.2, 1.1, 0.0]])
    gen = make_generator(123)
    batch = make_batch([SamplingParams(temperature=1.0, seed=123)], [gen])
    tokens = [SAMPLER(logits, batch).token_ids[0] for _ in range(3000)]
    assert chi_square(tokens, torch.softmax(logits[0], dim=0)) < CHI2_999[3]


# --------------------------------------------------------------------------- batch building


def test_from_params_flags_and_shapes() -> None:
    params = [SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(top_k=3, min_p=0.1)]
    batch = make_batch(params)
    assert batch.temperature.tolist() == [0.0, 1.0]
    assert batch.top_k.dtype == torch.int64
    assert (batch.all_greedy, batch.all_random, batch.no_penalties) == (False, False, True)
    # Filter flags look at random rows only.
    assert (batch.no_top_k, batch.no_top_p, batch.no_min_p) == (False, True, False)
    with pytest.raises(ValueError, match="row count"):
        SamplingBatch.from_params(params, [None])
    with pytest.raises(ValueError, match="logits must be"):
        SAMPLER(torch.zeros(3, 5), batch)


def test_half_precision_logits_are_accepted() -> None:
    logits = distinct_logits(3, 100, seed=9).to(torch.bfloat16)
    tokens = sample(logits, [SamplingParams(temperature=0.0)] * 3)
    assert tokens == logits.float().argmax(dim=-1).tolist()


def test_large_scaled_logits_next_to_a_top_p_row() -> None:
    # Row 1 has no top-p but shares a level with a top-p row; its scaled logits (~500)
    # must not overflow the top-p arithmetic and cut its min-p set short.
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [50.0, 49.9, 49.8, 10.0]])
    params = [SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0.1, min_p=0.1)]
    kept = SAMPLER.kept_token_ids(logits, make_batch(params))
    assert kept == [[0], [0, 1, 2]]
