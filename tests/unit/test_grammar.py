"""Constrained decoding: the wire format, grammar compilation and its errors, the masked
sampler, the scheduler passing over compiling requests, and the engine end to end on the
embedded model (preemption replays the matcher: same output as unpreempted)."""

from __future__ import annotations

import json
import math
import random
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from tokenyard.engine.kv_cache import KVCacheManager
from tokenyard.engine.request import Request, RequestStatus
from tokenyard.engine.sample import Sampler, SamplingBatch
from tokenyard.engine.sample.grammar import GrammarCompiler, GrammarError, GuidedState
from tokenyard.engine.scheduler import Scheduler
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.protocol import params_from_json, params_to_json
from tokenyard.wire.sampling_params import GuidedDecoding, SamplingParams, SamplingParamsError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]},
                 "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
GUIDED = GuidedDecoding("json_schema", json.dumps(PERSON))


# -- the wire ---------------------------------------------------------------------------------

def test_guided_crosses_the_wire_both_ways_and_absent_is_none() -> None:
    params = SamplingParams(max_tokens=9, guided=GuidedDecoding("regex", "a+", param="p"))
    assert params_from_json(json.loads(json.dumps(params_to_json(params)))) == params
    plain = params_to_json(SamplingParams())
    assert "guided" not in plain
    assert params_from_json(plain).guided is None


def test_bad_guided_kinds_name_the_param() -> None:
    with pytest.raises(SamplingParamsError) as info:
        GuidedDecoding("xml", "<a/>", param="response_format")
    assert info.value.param == "response_format"
    with pytest.raises(SamplingParamsError):
        GuidedDecoding("regex", "")
    with pytest.raises(ValueError):
        params_from_json({"guided": {"kind": 3, "spec": "x"}})


# -- compiling --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(embedded_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(embedded_gguf_path)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def test_compiles_are_cached_by_spec(compiler: GrammarCompiler) -> None:
    first = compiler.submit(GUIDED)
    first.result(timeout=60)
    again = compiler.submit(GuidedDecoding("json_schema", json.dumps(PERSON), param="other"))
    assert again is first and again.done()
    assert compiler.submit(GuidedDecoding("json_schema", json.dumps(PERSON),
                                          any_whitespace=True)) is not first


@pytest.mark.parametrize(("guided", "words"), [
    (GuidedDecoding("json_schema", "{not json", param="response_format.json_schema.schema"),
     "not valid JSON"),
    (GuidedDecoding("json_schema", json.dumps({"type": "wat"}), param="f"), "wat"),
    (GuidedDecoding("json_schema", json.dumps({"properties": {"a": {"not": {}}}}), param="f"),
     "'not'"),
    (GuidedDecoding("json_schema", json.dumps({"type": "string", "format": "email",
                                               "maxLength": 9}), param="f"), "'maxLength'"),
    (GuidedDecoding("regex", "[a-", param="guided_regex"), "Unclosed"),
    (GuidedDecoding("ebnf", 'root ::= "a" | b', param="g"), "not defined"),
    (GuidedDecoding("structural_tag", '{"type": "structural_tag", "format": {"type": "x"}}',
                    param="tools"), "x"),
])
def test_invalid_grammars_raise_grammar_error_naming_the_field(
    compiler: GrammarCompiler, guided: GuidedDecoding, words: str,
) -> None:
    with pytest.raises(GrammarError) as info:
        compiler.compile(guided)
    assert info.value.param == guided.param
    assert words in str(info.value)
    assert "/project/" not in str(info.value)  # XGrammar's source paths are cut off


def test_a_cached_failure_names_the_field_of_the_request_that_asked(
    compiler: GrammarCompiler,
) -> None:
    """The same bad schema through two routes: each refusal names its own field, though
    the second is answered from the first's cached compile."""
    schema = '{"not": {"type": "string"}}'
    first = compiler.state(GuidedDecoding("json_schema", schema, param="text.format.schema"),
                           [])
    with pytest.raises(GrammarError):
        first.future.result()
    assert first.error is not None and first.error.param == "text.format.schema"
    second = compiler.state(GuidedDecoding(
        "json_schema", schema, param="response_format.json_schema.schema"), [])
    assert second.future is first.future  # from the cache
    assert second.error is not None
    assert second.error.param == "response_format.json_schema.schema"
    assert "'not'" in str(second.error)


@pytest.mark.parametrize(("fmt", "good", "bad"), [
    ("date", ["2024-02-28", "0001-12-31"], ["0000-01-01", "2023-02-30", "2023-04-31"]),
    ("date-time", ["2024-01-31T23:59:59.5+02:00"], ["2024-01-31T10:00:60Z", "2024-01-31T10:00"]),
    ("time", ["10:00:00Z"], ["24:00:00Z"]),
])
def test_date_formats_give_only_dates_python_parses(
    compiler: GrammarCompiler, tokenizer: Tokenizer, fmt: str, good: list[str], bad: list[str],
) -> None:
    guided = GuidedDecoding("json_schema", json.dumps({"type": "string", "format": fmt}))
    for text, ok in [*((g, True) for g in good), *((b, False) for b in bad)]:
        matcher = GuidedState(guided, compiler.submit(guided),
                              tokenizer.eos_token_ids).matcher_for([])
        assert (matcher.accept_string(json.dumps(text)) and matcher.is_completed()) is ok, text


def test_structural_tag_forces_the_tagged_json(compiler: GrammarCompiler,
                                               tokenizer: Tokenizer) -> None:
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"],
        "tags": [{"begin": "<tool_call>", "end": "</tool_call>",
                  "content": {"type": "json_schema", "json_schema": PERSON}}],
        "at_least_one": True, "stop_after_first": True}}
    state = GuidedState(GuidedDecoding("structural_tag", json.dumps(tag)),
                        compiler.submit(GuidedDecoding("structural_tag", json.dumps(tag))),
                        tokenizer.eos_token_ids)
    matcher = state.matcher_for([])
    assert not matcher.accept_string("hello")  # at_least_one: the tag comes first
    assert matcher.accept_string('<tool_call>{"name": "x", "age": 3}</tool_call>')
    assert matcher.is_completed()
    dated = json.loads(json.dumps(tag))
    dated["format"]["tags"][0]["content"]["json_schema"] = {"type": "string", "format": "date"}
    guided = GuidedDecoding("structural_tag", json.dumps(dated))
    matcher = GuidedState(guided, compiler.submit(guided), tokenizer.eos_token_ids).matcher_for([])
    assert not matcher.accept_string('<tool_call>"0000-01-01"')  # tag contents prepared too
    dated["format"]["tags"][0]["content"]["json_schema"] = {"not": {}}
    with pytest.raises(GrammarError, match="'not'"):
        compiler.compile(GuidedDecoding("structural_tag", json.dumps(dated), param="tools"))


# -- the masked sampler -----------------------------------------------------------------------

def _mask(vocab: int, allowed: dict[int, list[int]], rows: int) -> torch.Tensor:
    words = -(-vocab // 32)
    mask = torch.full((rows, words), -1, dtype=torch.int32)
    for row, tokens in allowed.items():
        mask[row] = 0
        for t in tokens:
            mask[row, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    return mask


def test_sampler_picks_only_allowed_tokens_and_logprobs_are_masked() -> None:
    vocab = 1000
    torch.manual_seed(0)
    logits = torch.randn(3, vocab)
    params = [SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5,
                             presence_penalty=0.5, logit_bias={7: 5.0}, seed=3),
              SamplingParams(temperature=1.0, logprobs=2)]
    allowed = {0: [5, 900], 1: [7, 8, 33, 64]}
    original = logits.clone()
    for _ in range(20):
        batch = SamplingBatch.from_params(params, output_token_ids=[[], [8, 8], []])
        batch.token_bitmask, batch.bitmask_rows = _mask(vocab, allowed, 3), [0, 1]
        out = Sampler()(logits, batch)
        assert out.token_ids[0] == max(allowed[0], key=lambda t: logits[0, t].item())
        assert out.token_ids[1] in allowed[1]
        assert out.logprobs is not None and out.top_logprobs is not None
        masked = torch.log_softmax(logits[0, allowed[0]], dim=-1)
        assert math.isclose(out.logprobs[0], masked.max().item(), abs_tol=1e-5)
        assert [t for t, _ in out.top_logprobs[0]] == sorted(
            allowed[0], key=lambda t: -logits[0, t].item())  # only the 2 allowed, not 5
        assert len(out.top_logprobs[2]) == 2  # the unconstrained row is untouched
    assert torch.equal(logits, original)  # the caller's logits are never written


# -- the scheduler ----------------------------------------------------------------------------

def test_a_compiling_request_waits_while_the_others_run() -> None:
    scheduler = Scheduler(KVCacheManager(64, 4), max_num_batched_tokens=64)
    pending: Future[Any] = Future()
    slow = Request("slow", [1, 2, 3], SamplingParams(max_tokens=2, guided=GUIDED))
    slow.guided = GuidedState(GUIDED, pending, [0])
    fast = Request("fast", [4, 5, 6], SamplingParams(max_tokens=2))
    scheduler.add_request(slow)
    scheduler.add_request(fast)
    out = scheduler.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["fast"]
    assert scheduler.num_waiting == 1 and slow.status is RequestStatus.WAITING
    pending.set_result(None)
    scheduler.update(out, {"fast": 9})
    assert [r.request_id for r, _ in scheduler.schedule().scheduled] == ["fast", "slow"]


# -- the engine -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(embedded_gguf_path: Path) -> Any:
    from tokenyard.engine.llm import LLM

    return LLM(str(embedded_gguf_path))


def _prompts(llm: Any, count: int) -> list[list[int]]:
    rng = random.Random(5)
    names = ["cat", "ship", "tree", "river", "lamp", "cloud", "bell", "fox"]
    return [llm.frontend.prompt_token_ids(
        [{"role": "user", "content": f"Describe a {rng.choice(names)} named "
                                     f"{rng.choice(names)} as a JSON person record."}])
        for _ in range(count)]


def test_constrained_outputs_validate_and_finish_with_stop(llm: Any) -> None:
    params = [SamplingParams(temperature=1.0, max_tokens=120, guided=GUIDED, logprobs=1),
              SamplingParams(temperature=1.0, max_tokens=30),
              SamplingParams(temperature=0.0, max_tokens=20,
                             guided=GuidedDecoding("regex", r"(red|green|blue)!"))]
    person, _free, colour = llm.generate(_prompts(llm, 3), params)
    completion = person.completions[0]
    assert completion.finish_reason == "stop"
    jsonschema.validate(json.loads(completion.text), PERSON)
    assert all(lp.logprob > -math.inf for lp in completion.logprobs)
    assert colour.completions[0].text in ("red!", "green!", "blue!")


def test_an_invalid_grammar_aborts_or_is_refused_never_runs(llm: Any) -> None:
    bad = SamplingParams(max_tokens=4, guided=GuidedDecoding("regex", "(", param="r"))
    try:  # still compiling when added: the core aborts it once the compile fails
        first = llm.generate([[1, 2, 3]], bad)[0].completions[0]
        assert first.finish_reason == "abort" and first.text == ""
    except GrammarError as exc:  # already failed when added
        assert exc.param == "r"
    with pytest.raises(GrammarError):  # cached as failed: now refused when added
        llm.generate([[1, 2, 3]], bad)


def test_preempted_constrained_requests_replay_their_matcher(embedded_gguf_path: Path,
                                                             llm: Any) -> None:
    from tokenyard.engine.llm import LLM

    prompts = _prompts(llm, 6)
    params = [SamplingParams(temperature=0.0, max_tokens=40, guided=GUIDED)] * 3 + [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=40, guided=GUIDED)
        for i in range(3)]
    expected = [r.completions[0].text for r in llm.generate(prompts, params)]
    small = LLM(str(embedded_gguf_path), num_kv_blocks=14, enable_prefix_caching=False)
    got = [r.completions[0].text for r in small.generate(prompts, params)]
    assert small.core.stats().num_preemptions > 0
    assert got == expected
    for text in got:
        jsonschema.validate(json.loads(text), PERSON)
