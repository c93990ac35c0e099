"""The real Gemma 3 270M (Q4_K_M GGUF from its PyPI chunk packages, `--model gemma3-270m`):
it loads, tokenizes as transformers does and greedily completes English sensibly.

Skipped when the chunk packages are not installed, failed instead when CI is set (the
Makefile installs them). The first run joins and converts the model into the cache
(tens of seconds); later runs load the cache entry in seconds.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import in_ci
from tests.unit.test_sentencepiece import gemma_tokenizer_ids
from tokenyard.engine.llm import LLM
from tokenyard.text.model_files import PACKAGED_MODELS
from tokenyard.wire.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def gemma() -> LLM:
    missing = [p for p in PACKAGED_MODELS["gemma3-270m"].chunk_packages
               if importlib.util.find_spec(p) is None]
    if missing:
        reason = f"Gemma 3 270M chunk packages not installed: {', '.join(missing)}"
        if in_ci():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return LLM("gemma3-270m", device="cpu")


def test_gemma_270m_loads_as_gemma3(gemma: LLM) -> None:
    config = gemma.frontend.model_config
    assert config.architecture == "gemma3"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (18, 640, 262144)
    assert config.sliding_window == 512
    assert config.layer_types is not None and config.layer_types.count("full_attention") == 3
    # A base model: its GGUF carries no chat template, so it serves completions only.
    assert gemma.tokenizer.chat_template is None


def test_gemma_270m_tokenizes_like_transformers(gemma: LLM) -> None:
    gemma_tokenizer_ids(gemma.tokenizer)


def test_gemma_270m_greedily_continues_a_count(gemma: LLM) -> None:
    out = gemma.generate("1, 2, 3, 4, 5,", SamplingParams(max_tokens=9, temperature=0.0))
    assert out[0].text.startswith(" 6, 7, 8"), out[0].text
    story = gemma.generate("Once upon a time, there was a little",
                           SamplingParams(max_tokens=3, temperature=0.0))
    assert story[0].text == " girl named Lily", story[0].text
