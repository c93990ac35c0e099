"""`best_of`'s choice and the fields' checks (api/openai/completion_fields.py)."""

from __future__ import annotations

import pytest

from tokenyard.api.openai.completion_fields import BestOf, choose, engine_logprobs, engine_n
from tokenyard.api.openai.schemas import CompletionRequest
from tokenyard.errors import APIError
from tokenyard.wire.outputs import Completion, Logprob


def _completion(index: int, *logprobs: float) -> Completion:
    return Completion(index, f"c{index}", list(range(len(logprobs))),
                      [Logprob(0, lp) for lp in logprobs])


def test_the_n_highest_cumulative_logprobs_come_first_renumbered() -> None:
    per_prompt = [_completion(0, -1.0, -1.0), _completion(1, -0.1, -0.2),
                  _completion(2, -3.0), _completion(3, -0.5, -0.5)]
    [chosen] = choose([per_prompt], BestOf(2, logprobs=True))
    assert [(c.index, c.text) for c in chosen] == [(0, "c1"), (1, "c3")]
    assert chosen[0].logprobs is not None
    [bare] = choose([per_prompt], BestOf(1, logprobs=False))
    assert [(c.text, c.logprobs) for c in bare] == [("c1", None)]


def test_best_of_asks_the_engine_for_best_of_completions_and_their_logprobs() -> None:
    req = CompletionRequest(model="m", prompt="x", best_of=3)
    assert (engine_n(req, 1, 1), engine_logprobs(req, 1)) == (3, 0)
    req = CompletionRequest(model="m", prompt="x", best_of=3, logprobs=2, n=3)
    assert (engine_n(req, 3, 1), engine_logprobs(req, 3)) == (3, 2)
    with pytest.raises(APIError) as err:
        engine_n(CompletionRequest(model="m", prompt="x", best_of=3, stream=True), 1, 1)
    assert err.value.param == "best_of"
