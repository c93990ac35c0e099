"""n-gram prompt lookup and draft verification (engine/spec/): the proposer finds the
latest earlier occurrence of the longest suffix; the acceptance rule keeps the target's
distribution (a chi-square test over whole sequences of a toy Markov target)."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from tokenyard.engine.spec.ngram import NgramConfig, NgramState, Pacer
from tokenyard.engine.spec.verify import accepted_tokens


def test_proposes_what_followed_the_latest_longest_match() -> None:
    config = NgramConfig(k=3, min_n=1, max_n=3)
    # "5 6 7" occurs twice before the end; the latest is followed by 1 2.
    state = NgramState([5, 6, 7, 8, 9, 0, 5, 6, 7, 1, 2, 4, 5, 6, 7])
    assert state.propose(config) == [1, 2, 4]
    # Only the last token matches earlier: the 1-gram is used.
    assert NgramState([3, 4, 9, 3]).propose(config) == [4, 9, 3]
    assert NgramState([1, 2, 3, 4]).propose(config) == []
    # Near the end of the context fewer than k tokens follow.
    assert NgramState([1, 2, 1]).propose(config) == [2, 1]


def test_the_longer_match_wins_over_a_later_shorter_one() -> None:
    config = NgramConfig(k=1, min_n=1, max_n=2)
    # The bigram "1 2" occurs at 0 (followed by 7); "2" alone occurs later (followed by 8).
    assert NgramState([1, 2, 7, 2, 8, 1, 2]).propose(config) == [7]


def test_state_grows_and_truncates() -> None:
    state = NgramState([1, 2])
    state.extend(list(range(3, 300)))
    assert len(state) == 299
    state.extend([1, 2])
    assert state.propose(NgramConfig(k=2, min_n=2, max_n=2)) == [3, 4]
    state.truncate(10)
    assert len(state) == 10 and state.propose(NgramConfig(k=2, min_n=2, max_n=2)) == []


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        NgramConfig(min_n=3, max_n=2)
    with pytest.raises(ValueError):
        NgramConfig(k=0)


def test_accepts_the_agreeing_prefix_then_the_targets_token() -> None:
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accepted_tokens([4], [1, 2]) == [1]
    assert accepted_tokens([], [3]) == [3]
    with pytest.raises(ValueError):
        accepted_tokens([1, 2], [1, 2])


def test_pacer_pauses_a_request_whose_drafts_are_rejected_and_tries_again() -> None:
    pacer = Pacer(min_steps=3, pause_steps=2)
    for _ in range(3):  # the average falls from 0.5 to 0.17 (decay 0.7)
        assert pacer.active
        pacer.record(4, 0)
    assert not pacer.active
    pacer.tick()
    pacer.tick()
    assert pacer.active and pacer.rate == 1.0
    # On probation: one rejected step pauses it again, twice as long, and again.
    for pause in (4, 8):
        pacer.record(4, 0)
        for _ in range(pause):
            assert not pacer.active
            pacer.tick()
        assert pacer.active
    # A try that pays resumes it; its next pause is the first one again.
    pacer.record(4, 3)
    for _ in range(4):  # 0.925 falls to 0.22 in four rejected steps
        assert pacer.active
        pacer.record(4, 0)
    assert pacer.paused == 2
    good = Pacer(min_steps=3)
    for _ in range(20):
        good.record(4, 3)
    assert good.active


# A toy target: the next token's distribution depends on the last token (vocab 4).
VOCAB = 4
TABLE = {prev: [w / sum(ws) for w in ws] for prev, ws in {
    0: [5, 3, 1, 1], 1: [1, 6, 2, 1], 2: [2, 2, 2, 4], 3: [7, 1, 1, 1]}.items()}
LENGTH = 3


def _sample(rng: random.Random, prev: int) -> int:
    return rng.choices(range(VOCAB), TABLE[prev])[0]


def _speculated(rng: random.Random) -> tuple[int, ...]:
    """A reply of LENGTH tokens after token 0, drafted by a guesser that is right only
    some of the time and verified by sampling the target at every draft position."""
    out = [0]
    while len(out) - 1 < LENGTH:
        drafts = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
        context = out[-1:] + drafts  # the target sees each draft as accepted
        sampled = [_sample(rng, context[i]) for i in range(len(drafts) + 1)]
        out += accepted_tokens(drafts, sampled)
    return tuple(out[1:LENGTH + 1])


def test_verification_keeps_the_target_distribution() -> None:
    rng = random.Random(7)
    trials = 20000
    seen = Counter(_speculated(rng) for _ in range(trials))
    chi2 = 0.0
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        p, prev = 1.0, 0
        for token in seq:
            p, prev = p * TABLE[prev][token], token
        expected = p * trials
        chi2 += (seen[seq] - expected) ** 2 / expected
    # 63 degrees of freedom: the 0.999 quantile is about 103.4.
    assert chi2 < 103.4, chi2
