"""A deployment's output caps (issue 27, "no runaway"): the fleet file's
`max_output_tokens` and `max_tool_calls`, `fit` filling and refusing by the cap, and the
tool grammar allowing at most the capped number of calls (checked with XGrammar itself)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string

from tokenyard.deployments import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    DEFAULT_MAX_TOOL_CALLS,
    FleetConfigError,
    parse_fleet,
    single_fleet,
)
from tokenyard.errors import APIError
from tokenyard.text.prepare import fit
from tokenyard.text.tool_grammar import call_limit, constrained, structural_tag
from tokenyard.text.tools import Tool, ToolChoice, ToolUse
from tokenyard.wire.sampling_params import SamplingParams

TOOLS = (Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}},
                                  "required": ["city"], "additionalProperties": False}),)


def _call(city: str = "Paris") -> str:
    return f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}</tool_call>'


def _fleet(**fields: Any) -> dict[str, Any]:
    return {"deployments": [{"name": "m", "replicas": 1, **fields}]}


def test_a_generating_deployment_gets_the_default_caps() -> None:
    spec = parse_fleet(_fleet()).deployments["m"]
    assert spec.max_output_tokens == DEFAULT_MAX_OUTPUT_TOKENS
    assert spec.max_tool_calls == DEFAULT_MAX_TOOL_CALLS
    spec = parse_fleet(_fleet(max_output_tokens=64, max_tool_calls=2)).deployments["m"]
    assert (spec.max_output_tokens, spec.max_tool_calls) == (64, 2)
    upstream = parse_fleet({"deployments": [{
        "name": "u", "kind": "upstream", "urls": ["http://h/v1"], "model": "x",
        "max_output_tokens": 4096}]}).deployments["u"]
    assert upstream.max_output_tokens == 4096
    only = single_fleet("m").deployments["m"]
    assert only.max_output_tokens == DEFAULT_MAX_OUTPUT_TOKENS
    assert single_fleet("m", max_output_tokens=32).deployments["m"].max_output_tokens == 32


@pytest.mark.parametrize("fields", [
    {"max_output_tokens": 0}, {"max_output_tokens": "1024"}, {"max_output_tokens": True},
    {"max_tool_calls": 0}, {"max_tool_calls": 1.5},
])
def test_a_bad_cap_is_refused_naming_the_field(fields: dict[str, Any]) -> None:
    with pytest.raises(FleetConfigError, match=next(iter(fields))):
        parse_fleet(_fleet(**fields))


def test_an_embeddings_deployment_has_no_output_cap() -> None:
    spec = parse_fleet({"deployments": [{"name": "e", "kind": "embeddings", "replicas": 1}]})
    assert spec.deployments["e"].max_output_tokens is None
    with pytest.raises(FleetConfigError, match="generates no output"):
        parse_fleet({"deployments": [{"name": "e", "kind": "embeddings", "replicas": 1,
                                      "max_output_tokens": 10}]})


def test_fit_fills_the_rest_of_the_window_at_most_the_cap() -> None:
    params = SamplingParams(max_tokens=None)
    assert fit(10, params, "messages", 8192, 1024).max_tokens == 1024
    assert fit(8000, params, "messages", 8192, 1024).max_tokens == 192
    assert fit(10, params, "messages", 8192).max_tokens == 8182  # no cap: the window
    assert fit(10, SamplingParams(max_tokens=1024), "max_tokens", 8192, 1024).max_tokens == 1024


@pytest.mark.parametrize(("param", "named"), [
    ("max_tokens", "max_tokens"), ("max_completion_tokens", "max_completion_tokens"),
    ("max_output_tokens", "max_output_tokens"),
    ("messages", "max_tokens"),  # chat points window errors at the prompt
])
def test_more_than_the_cap_is_a_400_naming_the_parameter(param: str, named: str) -> None:
    with pytest.raises(APIError) as caught:
        fit(10, SamplingParams(max_tokens=1025), param, 8192, 1024)
    assert caught.value.status == 400 and caught.value.param == named
    assert "1024" in str(caught.value.message) and named in str(caught.value.message)


def test_the_call_limit_is_the_least_of_the_request_and_the_deployment() -> None:
    assert call_limit(ToolUse(TOOLS), 8) == 8
    assert call_limit(ToolUse(TOOLS, max_calls=3), 8) == 3
    assert call_limit(ToolUse(TOOLS, max_calls=30), 8) == 8
    assert call_limit(ToolUse(TOOLS, ToolChoice(parallel=False)), 8) == 1
    # A named tool is one call, parallel calls allowed or not (issue 29).
    named = ToolUse(TOOLS, ToolChoice("required", TOOLS[0].name, parallel=True), max_calls=5)
    assert call_limit(named, 8) == 1
    assert structural_tag(named, 1)["format"]["stop_after_first"] is True
    assert call_limit(ToolUse(TOOLS), None) is None


def _accepts(tag: dict[str, Any], text: str) -> bool:
    return bool(_is_grammar_accept_string(Grammar.from_structural_tag(json.dumps(tag)), text))


@pytest.mark.parametrize("limit", [1, 3, DEFAULT_MAX_TOOL_CALLS])
def test_a_forced_reply_has_at_most_the_limit_of_calls(limit: int) -> None:
    """With `required`, 1 to `limit` calls a line apart, and nothing after the last:
    the grammar allows only the end of the turn (before, any number of calls)."""
    tag = structural_tag(ToolUse(TOOLS, ToolChoice("required")), limit)
    assert not _accepts(tag, "")
    for n in range(1, limit + 1):
        assert _accepts(tag, "\n".join(_call() for _ in range(n))), n
    assert not _accepts(tag, "\n".join(_call() for _ in range(limit + 1)))


def test_an_auto_reply_has_at_most_the_limit_of_calls() -> None:
    tag = structural_tag(ToolUse(TOOLS), 3)
    assert _accepts(tag, "Just text.")
    assert _accepts(tag, f"Let me check. {_call()} and {_call('Rome')} then")
    assert _accepts(tag, f"a {_call()} b {_call()} c {_call()}")
    assert not _accepts(tag, f"a {_call()} b {_call()} c {_call()} d {_call()}")
    assert not _accepts(tag, f"{_call()}{_call()}{_call()}{_call()}")


def test_constrained_applies_the_deployments_cap() -> None:
    guided = constrained(SamplingParams(), ToolUse(TOOLS, ToolChoice("required")), 2).guided
    assert guided is not None
    tag = json.loads(guided.spec)
    assert _accepts(tag, f"{_call()}\n{_call()}")
    assert not _accepts(tag, f"{_call()}\n{_call()}\n{_call()}")
    unbounded = constrained(SamplingParams(), ToolUse(TOOLS, ToolChoice("required")), None)
    assert unbounded.guided is not None
    assert _accepts(json.loads(unbounded.guided.spec), "\n".join(_call() for _ in range(12)))
