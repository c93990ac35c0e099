"""`/v1/completions` with `echo` and `logprobs` through the official `openai` SDK (issue
29, defect 8): the choice's logprobs cover the prompt's tokens (the first without a
logprob) and then the generated ones; with `max_tokens` 0 the prompt alone, scored (an
evaluation harness's log-likelihood). Every body is checked against OpenAI's OpenAPI
document.

Before: `echo` with `logprobs` was a 400 ("not supported yet"), and `max_tokens` 0 too.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import openai
import pytest

from tests.conformance.spec import Spec
from tests.e2e.conftest import Server
from tokenyard.api.openai.legacy_logprobs import token_string
from tokenyard.config import EngineConfig
from tokenyard.text.model_files import load_tokenizer
from tokenyard.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of Italy is"
TOP = 3


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key,
                         max_retries=0)


@cache
def tokenizer() -> Tokenizer:
    """The served (embedded) model's tokenizer, read here to spell prompts as token ids."""
    return load_tokenizer(None, EngineConfig.from_env().cache_dir)


def _valid(body: dict[str, Any]) -> None:
    """Valid against the spec's CreateCompletionResponse, but for the nulls of the first
    echoed token: OpenAI answers them (the first token has no logprob), and its document
    types those list items as numbers and objects only."""
    spec = Spec.load("openai")
    errors = list(spec.errors(body, spec.response_schema("/completions", 200)))
    allowed = {("choices", i, "logprobs", key, 0) for i in range(len(body["choices"]))
               for key in ("token_logprobs", "top_logprobs")}
    assert all(tuple(e.absolute_path) in allowed and e.instance is None for e in errors), [
        (list(e.absolute_path), e.message) for e in errors]


def _create(client: openai.OpenAI, **kw: Any) -> dict[str, Any]:
    raw = client.completions.with_raw_response.create(**kw)
    body: dict[str, Any] = json.loads(raw.text)
    _valid(body)
    return body


def _check_prompt_part(lp: dict[str, Any], tokens: list[str]) -> None:
    """The echoed prompt's entries: its tokens, the first unscored, logprobs <= 0, at most
    TOP alternatives, offsets the running length of the tokens' text."""
    n = len(tokens)
    assert lp["tokens"][:n] == tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0.0 for v in lp["token_logprobs"][1:n])
    assert all(1 <= len(top) <= TOP for top in lp["top_logprobs"][1:n])
    assert lp["text_offset"][:n] == [len("".join(tokens[:i])) for i in range(n)]


def test_max_tokens_0_returns_the_prompt_scored_and_no_completion(
    client: openai.OpenAI, server: Server,
) -> None:
    body = _create(client, model=server.model, prompt=PROMPT, echo=True, logprobs=TOP,
                   max_tokens=0)
    (choice,) = body["choices"]
    expected = [token_string(tokenizer().id_to_token_bytes(t))
                for t in tokenizer().encode(PROMPT, add_special_tokens=True)]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(expected)
    _check_prompt_part(lp, expected)
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(expected)
    # "Paris" after "The capital of France is" is among the model's likeliest tokens.
    paris = lp["tokens"].index(" Paris")
    assert " Paris" in lp["top_logprobs"][paris]
    # The same prompt again (now in the prefix cache) is scored the same.
    again = _create(client, model=server.model, prompt=PROMPT, echo=True, logprobs=TOP,
                    max_tokens=0)
    assert again["choices"][0]["logprobs"] == lp


def test_the_prompt_scores_equal_the_generated_tokens_logprobs(
    client: openai.OpenAI, server: Server,
) -> None:
    """Teacher forcing checked against decoding: the greedy continuation's own logprobs
    (one decode step each) equal its tokens' scores when the prompt plus continuation is
    sent back as a prompt and scored in one prefill; the prompt's log-likelihood sums
    them."""
    tok = tokenizer()
    prompt_ids = tok.encode(PROMPT, add_special_tokens=True)
    first = _create(client, model=server.model, prompt=prompt_ids, echo=True, logprobs=1,
                    max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    (choice,) = first["choices"]
    lp = choice["logprobs"]
    n = len(prompt_ids)
    assert len(lp["tokens"]) == n + 6 and first["usage"]["completion_tokens"] == 6
    _check_prompt_part(lp, lp["tokens"][:n])
    generated = lp["tokens"][n:]
    assert choice["text"] == tok.decode(prompt_ids) + "".join(generated)
    assert lp["text_offset"][n] == len(tok.decode(prompt_ids))
    by_text = {token_string(tok.id_to_token_bytes(i)): i for i in range(tok.vocab_size)}
    generated_ids = [by_text[t] for t in generated]
    assert tok.decode(generated_ids) == "".join(generated)

    scored = _create(client, model=server.model, prompt=prompt_ids + generated_ids,
                     echo=True, logprobs=1, max_tokens=0)
    again = scored["choices"][0]["logprobs"]
    assert again["tokens"] == lp["tokens"]
    decoded = sum(lp["token_logprobs"][n:])
    teacher_forced = sum(again["token_logprobs"][n:])
    assert abs(decoded - teacher_forced) <= 1e-3
    assert abs(sum(lp["token_logprobs"][1:n]) - sum(again["token_logprobs"][1:n])) <= 1e-3


def test_a_streamed_echo_carries_the_scored_prompt_first(
    client: openai.OpenAI, server: Server,
) -> None:
    common: dict[str, Any] = dict(model=server.model, prompt=PROMPT, echo=True, logprobs=TOP,
                                  max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    whole = _create(client, **common)["choices"][0]
    chunks = [c.model_dump() for c in client.completions.create(stream=True, **common)]
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT
    n = len(first["logprobs"]["tokens"])
    _check_prompt_part(first["logprobs"], whole["logprobs"]["tokens"][:n])
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == whole["text"]
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in chunks:
        logprobs = chunk["choices"][0]["logprobs"]
        for key, values in joined.items():
            values.extend(logprobs[key] if logprobs else [])
    assert joined["tokens"] == whole["logprobs"]["tokens"]
    assert joined["text_offset"] == whole["logprobs"]["text_offset"]
    assert joined["token_logprobs"][0] is None
    assert all(abs(a - b) <= 1e-4 for a, b in zip(joined["token_logprobs"][1:],
                                                   whole["logprobs"]["token_logprobs"][1:],
                                                   strict=True))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_echo_without_logprobs_and_max_tokens_0_without_echo_are_as_before(
    client: openai.OpenAI, server: Server,
) -> None:
    body = _create(client, model=server.model, prompt=PROMPT, echo=True, max_tokens=2)
    assert body["choices"][0]["text"].startswith(PROMPT)
    assert body["choices"][0]["logprobs"] is None
    chunks = [c.model_dump() for c in client.completions.create(
        model=server.model, prompt=PROMPT, echo=True, max_tokens=2, stream=True)]
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)
    # Echo alone with max_tokens 0: the prompt, no scores (none were asked for), no tokens.
    body = _create(client, model=server.model, prompt=PROMPT, echo=True, max_tokens=0)
    assert body["choices"][0]["text"] == PROMPT and body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 0
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=0)
    assert err.value.body is not None and "max_tokens" in json.dumps(err.value.body)
