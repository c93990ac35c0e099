"""The Vercel AI SDK (`ai` with @ai-sdk/openai-compatible, @ai-sdk/openai and
@ai-sdk/anthropic) from node: tests/clients/js/cells.mjs runs every cell once against the
session's server and prints what the SDK handed back, one JSON line a cell; the checks
are here, the same ones the Python clients get.

Needs `node` on PATH: without it the cells skip, or fail where CI is set; its packages
come from `npm ci` in tests/clients/js, which `make test` runs when node is there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.clients.conftest import (
    EMBEDDING_MODEL,
    EMBEDDING_SIZE,
    WEATHER_RESULT,
    City,
    Target,
    check_city,
    check_embeddings,
    check_text,
    check_usage,
    check_weather_args,
)
from tests.conftest import require_service

pytestmark = pytest.mark.slow

JS = Path(__file__).parent / "js"
NODE = shutil.which("node")
#: The cells cells.mjs knows, by kind of check (the name's last part).
CELLS = [
    "compatible-chat", "compatible-stream", "compatible-structured", "compatible-tools",
    "compatible-embeddings",
    "openai-chat", "openai-structured", "openai-tools", "openai-embeddings",
    "openai-responses", "openai-responses-stream", "openai-responses-tools",
    "anthropic-chat", "anthropic-stream", "anthropic-structured", "anthropic-tools",
]


@pytest.fixture(scope="module")
def results(target: Target) -> dict[str, dict[str, Any]]:
    """Every cell's line, from one node process (its start and imports paid once)."""
    require_service("node", NODE is not None,
                    "it is not on PATH: the Vercel AI SDK cells need it")
    require_service("the AI SDK's npm packages", (JS / "node_modules").is_dir(),
                    f"{JS}/node_modules is missing (run `npm ci` there)")
    assert NODE is not None  # for mypy: require_service skipped or failed without it
    env = {**os.environ, "TOKENYARD_URL": target.server.base_url,
           "TOKENYARD_API_KEY": target.api_key, "TOKENYARD_MODEL": target.model,
           "TOKENYARD_EMBEDDING_MODEL": EMBEDDING_MODEL}
    done = subprocess.run([NODE, "cells.mjs", *CELLS], cwd=JS, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"cells.mjs exited {done.returncode}:\n{done.stderr[-3000:]}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {line["cell"]: line for line in lines}


def _check(cell: str, got: dict[str, Any]) -> None:
    kind = cell.rsplit("-", 1)[-1]
    if kind in ("chat", "responses", "stream"):
        check_text(got["text"], cell)
        u = got["usage"]
        check_usage(u["input"], u["output"], u["cached"], f"{cell} usage")
    elif kind == "structured":
        check_city(City.model_validate(got["object"]), f"{cell}: {got['object']!r}")
    elif kind == "tools":
        calls = got["calls"]
        assert calls and calls[0]["name"] == "get_weather", f"{cell}: no forced call: {got!r}"
        check_weather_args(calls[0]["args"], f"{cell} tool call")
        assert got["steps"] == 2 and any(WEATHER_RESULT in r for r in got["results"]), (
            f"{cell}: the tool's result did not go back for a second step: {got!r}")
        # The result went back to the model, which answered it (at temperature 0 SmolLM2
        # echoes it in a <tool_response>: text all the same).
        assert WEATHER_RESULT in got["secondRequest"], (
            f"{cell}: the second request did not carry the tool's result: {got!r}")
        check_text(got["text"], f"{cell}: the second step's answer")
    elif kind == "embeddings":
        check_embeddings([[0.0] * n for n in got["vectors"]], 2, cell)
        assert got["vectors"] == [EMBEDDING_SIZE] * 2
    else:
        raise AssertionError(f"no check for cell {cell}")


@pytest.mark.parametrize("name", CELLS)
def test_vercel_ai(name: str, results: dict[str, dict[str, Any]]) -> None:
    got = results.get(name)
    assert got is not None, f"cells.mjs printed nothing for {name}"
    assert got["ok"], f"{name} failed in node:\n{got.get('error')}"
    _check(name, got)
