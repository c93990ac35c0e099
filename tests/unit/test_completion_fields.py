"""`best_of`'s choice, `echo` with `logprobs` or `max_tokens` 0, and the fields' checks
(api/openai/completion_fields.py, legacy_logprobs.py)."""

from __future__ import annotations

import json

import pytest

from tokenyard.api.openai.completion_fields import (
    BestOf,
    choose,
    echo_only,
    engine_logprobs,
    engine_n,
)
from tokenyard.api.openai.convert import build_text_completion, completion_request_to_engine
from tokenyard.api.openai.legacy_logprobs import choice_logprobs, prompt_logprobs
from tokenyard.api.openai.schemas import CompletionRequest
from tokenyard.api.openai.stream import CompletionFormat
from tokenyard.errors import APIError
from tokenyard.wire.outputs import (
    Completion,
    CompletionDelta,
    Logprob,
    PromptLogprobs,
    RequestOutput,
)


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


# ---------------------------------------------------------------------------- echo, logprobs

#: A prompt "Hi there" of three tokens, scored; then " ok" generated.
TOKENS = {1: b"Hi", 2: b" th", 3: b"ere", 4: b" ok"}
PROMPT = PromptLogprobs([1, 2, 3], [Logprob(2, -1.5, [(2, -1.5), (4, -2.0)]),
                                    Logprob(3, -0.25, [(3, -0.25)])])


def test_echo_with_logprobs_asks_the_engine_to_score_the_prompt() -> None:
    _, params = completion_request_to_engine(
        CompletionRequest(model="m", prompt="x", echo=True, logprobs=2))
    assert (params.prompt_logprobs, params.logprobs, params.max_tokens) == (2, 2, 16)
    _, params = completion_request_to_engine(CompletionRequest(model="m", prompt="x", logprobs=2))
    assert params.prompt_logprobs is None
    # max_tokens 0 with echo: the engine scores the prompt and generates nothing.
    req = CompletionRequest(model="m", prompt="x", echo=True, logprobs=4, max_tokens=0)
    _, params = completion_request_to_engine(req)
    assert echo_only(req) and (params.prompt_logprobs, params.max_tokens) == (4, 0)
    req = CompletionRequest(model="m", prompt="x", echo=True, max_tokens=0)
    _, params = completion_request_to_engine(req)
    assert (params.prompt_logprobs, params.logprobs, params.max_tokens) == (0, None, 0)
    with pytest.raises(APIError) as err:  # without echo it means nothing: refused
        completion_request_to_engine(CompletionRequest(model="m", prompt="x", max_tokens=0))
    assert err.value.param == "max_tokens"


def test_echoed_logprobs_cover_the_prompt_then_the_output() -> None:
    done = Completion(0, " ok", [4], [Logprob(4, -0.75, [(4, -0.75)])], "length",
                      prompt_logprobs=PROMPT)
    body = build_text_completion(id="cmpl-x", model="m", created=1, completions=[[done]], n=1,
                                 prompt_tokens=3, token_bytes=TOKENS.__getitem__,
                                 echo_prompts=["Hi there"])
    choice = body.choices[0]
    assert choice.text == "Hi there ok" and choice.logprobs is not None
    lp = choice.logprobs
    assert lp.tokens == ["Hi", " th", "ere", " ok"]
    assert lp.token_logprobs == [None, -1.5, -0.25, -0.75]
    assert lp.top_logprobs == [None, {" th": -1.5, " ok": -2.0}, {"ere": -0.25}, {" ok": -0.75}]
    assert lp.text_offset == [0, 2, 5, 8]
    # Without echo the prompt's scores are left out; echo alone (max_tokens 0) keeps them.
    plain = build_text_completion(id="c", model="m", created=1, completions=[[done]], n=1,
                                  prompt_tokens=3, token_bytes=TOKENS.__getitem__)
    assert plain.choices[0].logprobs is not None
    assert plain.choices[0].logprobs.text_offset == [0]
    alone = Completion(0, "", [], None, "length", prompt_logprobs=PROMPT)  # max_tokens 0
    assert choice_logprobs(alone, TOKENS.__getitem__, "Hi there") == prompt_logprobs(
        PROMPT, TOKENS.__getitem__)
    # Scores computed only for max_tokens 0 are left out when logprobs were not asked for.
    fmt = CompletionFormat("m", 1, False, TOKENS.__getitem__, ["Hi there"], scored=False)
    body = fmt.body([], [[alone]])
    assert json.loads(body.model_dump_json())["choices"][0]["logprobs"] is None


def test_a_scored_echo_streams_with_its_choice_first_output() -> None:
    fmt = CompletionFormat("m", 1, False, TOKENS.__getitem__, ["Hi there"], scored=True)
    assert fmt.head() == []  # the prompt's scores come with the first output
    first = CompletionDelta(0, " ok", [4], [Logprob(4, -0.75, [])], None, None, PROMPT)
    chunks = fmt.events(0, RequestOutput("r", [first], False, 3, 0, 1))
    chunks += fmt.events(0, RequestOutput(
        "r", [CompletionDelta(0, "", [], None, "length", None)], True, 3, 0, 1))
    raws = [json.loads(c.model_dump_json())["choices"][0] for c in chunks]
    assert [r["text"] for r in raws] == ["Hi there", " ok", ""]
    assert raws[0]["logprobs"]["token_logprobs"] == [None, -1.5, -0.25]
    assert raws[1]["logprobs"]["text_offset"] == [8]
    assert raws[-1]["finish_reason"] == "length"
    # max_tokens 0: the engine's one output has no token; the choice ends by length.
    only = CompletionFormat("m", 1, False, TOKENS.__getitem__, ["Hi there"], scored=True)
    done = CompletionDelta(0, "", [], None, "length", None, PROMPT)
    raws = [json.loads(c.model_dump_json())["choices"][0]
            for c in only.events(0, RequestOutput("r", [done], True, 3, 0, 1))]
    assert [(r["text"], r["finish_reason"]) for r in raws] == [("Hi there", None), ("", "length")]
