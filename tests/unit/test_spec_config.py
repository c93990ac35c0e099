"""`--speculative-config` (vLLM's JSON): n-gram lookup or a draft model, vLLM's older
spelling without a method, and clear errors for what is not supported."""

from __future__ import annotations

import pytest

from tokenyard.engine.spec.draft import DraftConfig
from tokenyard.engine.spec.ngram import NgramConfig
from tokenyard.engine.spec.speculator import parse_speculative_config


def test_methods_and_the_older_spelling() -> None:
    assert parse_speculative_config(None) is None
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}') == \
        NgramConfig(k=3)
    assert parse_speculative_config('{"model": "[ngram]", "prompt_lookup_max": 3}') == \
        NgramConfig(max_n=3)
    assert parse_speculative_config(
        '{"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 5}') == \
        DraftConfig("d.gguf", 5)
    # No method and a model that is not "[ngram]": a draft model, as in vLLM.
    assert parse_speculative_config('{"model": "/m/draft"}') == DraftConfig("/m/draft", 4)


@pytest.mark.parametrize(("text", "match"), [
    ('{"method": "eagle", "model": "x"}', "'ngram' and 'draft_model' are supported"),
    ('{"method": "draft_model"}', "needs \"model\""),
    ('{"method": "draft_model", "model": "x", "prompt_lookup_min": 2}',
     "unknown field.*prompt_lookup_min"),
    ('{"model": "x", "draft_tensor_parallel_size": 1}', "unknown field"),
    ('{"method": "ngram", "model": "x"}', "takes no model"),
    ('{"method": "draft_model", "model": "x", "num_speculative_tokens": 0}', ">= 1"),
    ('{"model": "x", "num_speculative_tokens": "4"}', "must be an integer"),
])
def test_what_is_refused(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_speculative_config(text)
