from __future__ import annotations

from typing import Any

import pytest

from tokenyard.engine.llm import LLM


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The embedded model, float32 (pinned: `auto` would serve its Q4_1 blocks), default
    engine settings otherwise."""
    return LLM(weights="float32")


@pytest.fixture(scope="session")
def hf_model(llm: LLM) -> Any:
    """transformers' LlamaForCausalLM holding the same dequantized weights."""
    from tokenyard.bench.reference import transformers_model
    from tokenyard.engine.models.loader import load_model

    cfg = llm.frontend.config
    loaded = load_model(cfg.model, cfg.cache_dir, show_progress=False)
    return transformers_model(loaded.config, loaded.weights)
