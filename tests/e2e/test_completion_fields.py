"""`/v1/completions`' `best_of` and `suffix` through the official `openai` SDK (issue 29,
defect 8), every body checked against OpenAI's OpenAPI document.

Before: `best_of` > `n` was refused as not supported, and `suffix` with a generic "not
supported by this server yet" that did not say why.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.conformance.spec import Spec
from tests.e2e.conftest import Server

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
#: Each completion exactly this long, so usage is known.
TOKENS = 5


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                         max_retries=0)


def _valid(body: dict[str, Any]) -> None:
    spec = Spec.load("openai")
    spec.validate(body, spec.response_schema("/completions", 200), "/completions")


def _valid_error(err: openai.BadRequestError) -> None:
    """The spec gives no 400 body for the route: its ErrorResponse, as every error."""
    Spec.load("openai").validate({"error": err.body}, "ErrorResponse")


def _cumulative(choice: dict[str, Any]) -> float:
    return float(sum(choice["logprobs"]["token_logprobs"]))


def test_best_of_returns_the_n_most_likely_of_best_of_completions(
    client: openai.OpenAI, server: Server,
) -> None:
    common: dict[str, Any] = dict(model=server.model, prompt=PROMPT, max_tokens=TOKENS,
                                  temperature=1.0, seed=11, extra_body={"min_tokens": TOKENS})
    # The same seed gives the same three completions when both requests meet the same
    # batches: all of them, with their logprobs, then the best two of them. The engine is
    # not batch-invariant (nor is vLLM by default): under other traffic one greedy
    # request's logprobs moved by up to 8e-4 with the batches it met (a Zen 5, 2026-11-27),
    # enough to flip a sample at temperature 1, and even on an idle server the first of
    # such requests sometimes differed from the next ones there (cause not found). So up
    # to 3 pairs: best_of must match in one; a wrong ranking matches in none.
    for _ in range(3):
        every = client.completions.with_raw_response.create(n=3, logprobs=0, **common)
        every_body = json.loads(every.text)
        _valid(every_body)
        ranked = sorted(every_body["choices"], key=lambda c: (-_cumulative(c), c["index"]))
        best = client.completions.with_raw_response.create(n=2, best_of=3, logprobs=0,
                                                           **common)
        body = json.loads(best.text)
        _valid(body)
        if [c["text"] for c in body["choices"]] == [c["text"] for c in ranked[:2]]:
            break
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == [c["text"] for c in ranked[:2]]
    assert _cumulative(body["choices"][0]) >= _cumulative(body["choices"][1])
    # Usage counts every generated token, the one not returned included.
    assert body["usage"]["completion_tokens"] == 3 * TOKENS

    # Without logprobs asked for, they rank the completions but are not returned.
    for _ in range(3):
        plain = client.completions.with_raw_response.create(best_of=3, **common)
        plain_body = json.loads(plain.text)
        _valid(plain_body)
        if plain_body["choices"][0]["text"] == ranked[0]["text"]:
            break
    assert len(plain_body["choices"]) == 1 and plain_body["choices"][0]["logprobs"] is None
    assert plain_body["choices"][0]["text"] == ranked[0]["text"]
    assert plain_body["usage"]["completion_tokens"] == 3 * TOKENS


def test_best_of_is_refused_when_streamed_or_less_than_n(client: openai.OpenAI,
                                                         server: Server) -> None:
    for extra in ({"best_of": 2, "stream": True}, {"best_of": 1, "n": 2}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2,
                                      **extra)  # type: ignore[call-overload]
        assert err.value.param == "best_of", err.value.body
        _valid_error(err.value)


def test_suffix_is_refused_naming_it_and_saying_why(client: openai.OpenAI,
                                                    server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model, prompt="def add(a, b):\n",
                                  suffix="\n    return total\n", max_tokens=8)
    assert err.value.param == "suffix", err.value.body
    assert "fill-in-the-middle" in err.value.message
    _valid_error(err.value)
    # An empty suffix is no suffix (the SDKs send none; some clients send "").
    ok = client.completions.create(model=server.model, prompt=PROMPT, suffix="", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")
