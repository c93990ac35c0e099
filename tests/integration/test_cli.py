"""`tokenyard generate` as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenyard.cli", *args],
        capture_output=True, text=True, timeout=120,
    )


def test_generate_chat_streams_the_answer_and_reports_the_finish_reason() -> None:
    done = run_cli("generate", "What is the capital of France?", "--chat", "--max-tokens", "20")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "[finish_reason: stop]" in done.stderr


def test_generate_rejects_an_out_of_range_parameter_with_a_clear_message() -> None:
    done = run_cli("generate", "hi", "--temperature", "7")
    assert done.returncode == 2
    assert "temperature" in done.stderr
    assert "Traceback" not in done.stderr
